"""GPU measurements of the notebooks' own code (README.md here): `bash ci/gpu/run.sh`, or one of them with
`python -m ci.gpu.<name>` from the project's root."""
