"""The bottom floor: what imports nothing else of this project. Parameter validation (`validate`); the
"will it fit?" planner's arithmetic (`plan`, the machines it plans for in `hardware`, the real models'
configs in `architectures/`, `cost`, `flops`, and how a streamed checkpoint moves, `checkpoints`); the
meters a run is read with (`memory`, `metrics`, `sharding`); GLUE's task table (`glue`); Ray's view of the
cluster's nodes and the model's download on one (`cluster`); and the one reader of the notebooks' files
(`notebook_files`). `harness` and `helpers` build on it; it imports neither.
"""
