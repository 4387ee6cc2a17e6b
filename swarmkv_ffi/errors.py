"""The binding's exceptions, so callers can catch by meaning. Every exception the package
raises on purpose derives from SwarmKVError; those of one subsystem live beside it:
prefix_cache.CacheFolderError, fanout.dag.DagError / DagTimeoutError / DagStopped,
distributed.RayFanoutError, and in conductor/ LedgerDenied, ConductorError, DaemonError
and the client's LmxError.

describe(exc) is the one way an error becomes the line a user reads."""
import errno
import os


class SwarmKVError(Exception):
    """Base of every error raised by swarmkv_ffi."""


class LibraryNotFoundError(SwarmKVError):
    """libllama could not be located or loaded."""


class PinMismatchError(SwarmKVError):
    """The loaded libllama was not built from the llama.h our declarations were copied from."""


class CpuMismatchError(LibraryNotFoundError):
    """libllama was compiled for instruction sets this CPU lacks (it would die with SIGILL)."""


class ClosedError(SwarmKVError):
    """A Model, Context, Batch or Sampler was used after close()."""


class ModelLoadError(SwarmKVError):
    """A model file could not be loaded (missing, not GGUF, truncated, unsupported)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path or short name does not resolve to a file."""


class ContextError(SwarmKVError):
    """llama_init_from_model refused the requested context."""


class TokenizeError(SwarmKVError):
    """Tokenization or detokenization failed."""


class DecodeError(SwarmKVError):
    """llama_decode returned a non-zero code. Subclasses say which."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class NoKVSlotError(DecodeError):
    """llama_decode returned 1: the KV cache has no room for the batch."""


class DecodeAbortedError(DecodeError):
    """llama_decode returned 2: the abort callback stopped it."""


class InvalidBatchError(DecodeError):
    """llama_decode returned -1: the batch itself is malformed."""


class DecodeFailedError(DecodeError):
    """llama_decode returned < -1: a fatal compute error."""


class ExactModeError(ContextError):
    """Exact (batch-invariant) mode cannot be honoured by this library or backend."""


class StateError(SwarmKVError):
    """Getting or setting KV state failed or moved an unexpected number of bytes."""


class BudgetError(SwarmKVError, ValueError):
    """The requested work does not fit the context window."""


class SnapshotError(StateError):
    """A KV snapshot cannot be used: corrupt, truncated, or made for something else."""


class SnapshotCorruptError(SnapshotError):
    """The snapshot's bytes or file structure are damaged (checksum, size, magic)."""


class SnapshotMismatchError(SnapshotError):
    """The snapshot is intact but was made for another model, build, document or context."""


class OutputError(SwarmKVError):
    """An output the user asked for (a file, standard output) could not be written; the
    work itself is done and was reported."""


def describe(exc: BaseException) -> str:
    """One line for any error a user may see: an OSError says what failed, where and its
    errno's name (ENOSPC, EROFS...), not Python's '[Errno 28] ...: path' form."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return f"{where}{exc.strerror or os.strerror(exc.errno)} ({name})"
    return str(exc) or type(exc).__name__
