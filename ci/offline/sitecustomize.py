"""Offline guard, loaded by every Python process the tests start (kernels, Ray workers).

The tests put this folder on PYTHONPATH and set LLM_NOTEBOOKS_OFFLINE_GUARD to a log file.
Python imports `sitecustomize` at start-up, so each process patches `socket` before any
library runs: a TCP connection, or a UDP datagram, to anything but loopback is refused
(OSError) before a packet leaves, and recorded in the log, which the tests require to stay
empty. Code that catches the OSError and carries on still fails the test that way.
"""

import os

if os.environ.get("LLM_NOTEBOOKS_OFFLINE_GUARD"):
    from llm_notebooks_offline_guard import install

    install(os.environ["LLM_NOTEBOOKS_OFFLINE_GUARD"])
