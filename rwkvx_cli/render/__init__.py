"""The command line's output (rich), one module per command, imported from the module that draws it:

- `console`: the stdout and stderr consoles, errors as one line with an exit code (every command's, and
  the `python -m` tools' through entry.py), warnings, wide tables, progress of long work, number formats;
- `train`: `rwkvx init`'s model summary, `rwkvx train`'s live view or plain lines, and its outcome;
- `data`: `rwkvx data prepare` and `data merge`;
- `eval`: `rwkvx eval`, each of its modes;
- `bench`, `export`, `gradcheck`: those commands.

`explain`'s table and pictures are the explain package's own (rwkvx_cli/explain/render.py).
"""
