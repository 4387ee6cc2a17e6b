"""Every length at which the prefix cache changes its mind, in one place (tokens).

Each is a trade measured on a 2-core CPU with SmolLM2-135M; the docstring of each says
what it weighs. They are policy, not limits: nothing breaks on either side of them.
"""

#: A finished request shorter than this is not kept in the pool's cells: forking it would
#: save little, and its cells, wherever they sit, widen the range of cells every later step
#: attends over (a 10-token kept request below a 1.6k-token prompt made its prefill 25 %
#: slower). (device tier: conductor/pool.py)
KEEP_MIN = 32

#: A server request waits for a running request of its owner to decode a common opening
#: of at least this many more tokens than the pool already holds, then forks it.
#: (conductor/scheduler.py)
WAIT_FOR_PREFIX = 32

#: Evicted sequences shorter than this are not kept in host RAM: prefilling them is as
#: cheap as a copy. A preempted request sharing at least this many cells is recomputed,
#: not swapped. (host.py, conductor/scheduler.py)
HOST_MIN = 256

#: Prefixes shorter than this are neither stored on disk nor looked up there: decoding
#: them is cheaper than the disk. (disk.py)
DISK_MIN = 256

#: A paused prefix agent keeps no KV of its own when its tokens after the document are at
#: most this many: it is rebuilt from the shared document and a re-read of those tokens.
#: (conductor/agents.py)
REPLAY_MAX = 2048

#: The file store also keeps a document's state this many tokens short of its end: a
#: tokenizer merge with appended text stays behind it. (files.py, fanout/prefill.py)
TAIL = 16
