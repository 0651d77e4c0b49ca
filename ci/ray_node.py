"""`ray start` for the local cluster's nodes, kept on loopback: `python ci/ray_node.py start ...`.

Ray rewrites a node's `--node-ip-address=127.0.0.1`, and a driver's `RAY_ADDRESS=127.0.0.1:port`, to the
machine's routable address (`ray._private.services.resolve_ip_for_localhost`), and a node on that address
listens on every interface. Ray's own switch for a machine that must not be reached from outside is
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (its default on macOS and Windows): then 127.0.0.1 stays 127.0.0.1,
and the GCS, the raylets, the agents and the Ray Client server listen on loopback only. The local cluster's
nodes, and the drivers that attach to it (`cluster.env`), run with it (`harness.cluster.LOOPBACK_ONLY`).

With that switch Ray's command line refuses to start a second node ("Multi-node Ray clusters are not
supported on Windows and OSX"), a guard for those systems, where a cluster of machines is unsupported.
Here the second node is on this same machine: this wrapper lifts only that guard, for `ray start`'s own
process, and leaves the switch on for everything else, the node's processes included.
"""

from __future__ import annotations

import os
import sys
import types


def main() -> None:
    import ray._private.ray_constants as ray_constants
    import ray.scripts.scripts as scripts

    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        sys.exit("ci/ray_node.py: run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (loopback only)")
    # The command line's view of the constants: multi-node allowed. The address resolution
    # (ray._private.services) keeps reading the real module, where it is not: loopback stays loopback.
    constants = types.SimpleNamespace(**vars(ray_constants))
    constants.ENABLE_RAY_CLUSTER = True
    scripts.ray_constants = constants
    sys.argv[0] = "ray"
    sys.exit(scripts.main())


if __name__ == "__main__":
    main()
