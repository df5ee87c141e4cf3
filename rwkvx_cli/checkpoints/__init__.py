"""A checkpoint on disk, whole: the folder it lives in, both formats, writing in the background, and
the trainer's checkpointer. The trainer hands the manager its config and live state; eval, explain,
export and init --from read through `find`; nothing else reaches into a checkpoint's files.

    store       the checkpoints folder: held open while a save writes (Root), each file's size and
                SHA-256, meta.json, the step directories (listed, kept, damaged ones set aside)
    full        the full format: whole tensors, gathered from any parallelism, written by rank 0
    sharded     the sharded format: every rank writes its own rows; any number of ranks reads them
    find        either format: verified, the newest good one of a run, its weights opened
    ranks       which rank this is, what it holds, and how the ranks agree on a save or a load
    fit         whether weights fit a model: names, shapes, finite values
    background  asynchronous saves: the state staged into reused buffers, a thread that writes it
    manager     the trainer's checkpointer (CheckpointManager): what is saved and when, the resume

It builds on formats/ (safetensors read and written tensor by tensor), models/ (the optimizer's
implementation flags) and the config; runs/ and train/ build on it (tests/test_layering.py).
"""
