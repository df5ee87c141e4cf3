"""Imported by the tokenizer workers' forkserver only, as a preload (`pool._forkserver`): never import it elsewhere.

Ctrl-C reaches the whole process group, and this process stops the workers, so a worker ignores SIGINT. The
forkserver gives each worker it forks the signal handlers it had before its own start-up replaced them, and those
are saved after the preloads run: ignoring SIGINT here makes every worker start with it ignored, instead of from
`pool._worker` on, when a Ctrl-C during a worker's start printed a traceback from it.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
