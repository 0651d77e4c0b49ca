"""The bottom floor: what imports nothing else of this project and needs no cluster. Parameter validation
(`validate`), the "will it fit?" planner's arithmetic (`plan`, the machines it plans for in `hardware`, with the real models' configs in
`architectures/`; `cost`, `flops`; how a streamed checkpoint moves, `checkpoints`), the meters a run is read
with (`memory`, `metrics`, `sharding`), GLUE's task table (`glue`), and Ray's view of the cluster's nodes and
the model download on one (`cluster`), and the one reader of the notebooks' files (`notebook_files`). `harness` and `helpers` build on it; it imports neither.
"""
