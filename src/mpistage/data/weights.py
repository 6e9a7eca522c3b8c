"""Safetensors without a library: the header, checked, and arrays over the node's copy.

:func:`mpistage.data.tensors` runs these steps on every rank:

- plan (rank 0): a ``.safetensors`` file; or a directory: its
  ``*.safetensors.index.json`` (``model.safetensors.index.json`` first),
  whose ``weight_map`` names the shards, else its one ``model.safetensors``;
- stage: the file or the shards, once per node (:mod:`~mpistage.data.dirs`);
- header (rank 0, from its node's copy): each file's 8-byte little-endian
  length, then that many bytes of JSON: per tensor its ``dtype``, ``shape``
  and ``data_offsets`` into the bytes after the header, and an optional
  ``__metadata__`` of strings. A header is untrusted: a length past the file
  (or past safetensors' own limit of 100 MB), JSON that is not an object
  or repeats a name, an unknown dtype, offsets out of range, overlapping or
  leaving bytes unused, a shape whose bytes are not the offsets' span: each
  is one line, and nothing is mapped;
- map (every rank): each file mapped once, read-only (``np``) or
  copy-on-write (``pt``, as ``torch.load(mmap=True)`` maps), every tensor a
  view of it: no copy per rank, and the ranks of a node share the pages;
- end: once every rank has mapped, the copy's names are removed. The
  memory stays as long as some rank holds an array of it, no longer.
"""

import os as _os

from mpistage import StageError

MAX_HEADER = 100_000_000  # bytes: safetensors' own limit of a header
MAX_INDEX = 64 << 20  # bytes of an index file read at most
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FRAMEWORKS = ("np", "pt")
# name: (bits per value, numpy dtype ("ml_dtypes." where numpy has none), torch)
DTYPES = {
    "BOOL": (8, "bool", "bool"),
    "U8": (8, "u1", "uint8"),
    "I8": (8, "i1", "int8"),
    "U16": (16, "<u2", "uint16"),
    "I16": (16, "<i2", "int16"),
    "F16": (16, "<f2", "float16"),
    "BF16": (16, "ml_dtypes.bfloat16", "bfloat16"),
    "U32": (32, "<u4", "uint32"),
    "I32": (32, "<i4", "int32"),
    "F32": (32, "<f4", "float32"),
    "U64": (64, "<u8", "uint64"),
    "I64": (64, "<i8", "int64"),
    "F64": (64, "<f8", "float64"),
    "C64": (64, "<c8", "complex64"),
    "F8_E4M3": (8, "ml_dtypes.float8_e4m3fn", "float8_e4m3fn"),
    "F8_E5M2": (8, "ml_dtypes.float8_e5m2", "float8_e5m2"),
    "F8_E8M0": (8, "ml_dtypes.float8_e8m0fnu", "float8_e8m0fnu"),
    "F6_E2M3": (6, None, None),  # packed below a byte: no array type maps them
    "F6_E3M2": (6, None, None),
    "F4": (4, None, None),
}


class Plan:
    """What to stage: the directory (or file), the files, the index's facts."""

    def __init__(self, path, names=None, weight_map=None, index=None):
        self.path, self.names = path, names
        self.weight_map, self.index = weight_map, index


def check_framework(framework):
    """Refuse a framework other than ``"np"`` and ``"pt"``."""
    if framework not in FRAMEWORKS:
        raise StageError(f"framework={framework!r}: use 'np' (numpy) or 'pt' (torch)")


def plan(path):
    """Rank 0: what *path* holds to stage (a file, or a checkpoint's shards)."""
    import stat

    try:
        st = _os.stat(path)
    except OSError as exc:
        raise StageError(f"cannot read checkpoint {path!r}: {exc.strerror}") from None
    if stat.S_ISREG(st.st_mode):
        return Plan(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StageError(f"cannot read checkpoint {path!r}: not a file or directory")
    names = sorted(_os.listdir(path))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if INDEX in indexes or len(indexes) == 1:
        return sharded(path, INDEX if INDEX in indexes else indexes[0])
    if len(indexes) > 1:
        raise StageError(f"checkpoint {path!r} holds several indexes: {indexes}")
    if SINGLE in names:
        return Plan(path, [SINGLE])
    raise StageError(
        f"checkpoint {path!r} holds no {INDEX} (nor {SINGLE}): give the "
        ".safetensors file, or the directory of a sharded checkpoint"
    )


def sharded(folder, name):
    """The :class:`Plan` of the index *name* in *folder*: its shards, checked."""
    where = f"{folder}/{name}"
    index = read_json(where, MAX_INDEX, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise StageError(f"index {where!r} has no weight_map of tensor names to files")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not plain_name(shard):
            raise StageError(
                f"index {where!r} maps {tensor!r} to {shard!r}, not a file name "
                "beside the index"
            )
    metadata = index.get("metadata")
    names = sorted(set(weight_map.values()))
    return Plan(
        folder, names, weight_map, metadata if isinstance(metadata, dict) else {}
    )


def plain_name(name):
    """Whether *name* is a file name of its own (no directory, no ``..``)."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_json(path, limit, what):
    """Read the JSON object in the file *path* (at most *limit* bytes)."""
    from mpistage import read_fd
    from mpistage.runtime.read import open_regular

    fd = open_regular(path, what)
    try:
        size = _os.fstat(fd).st_size
        if size > limit:
            raise StageError(f"{what} {path!r} is {size} bytes, more than {limit}")
        raw = read_fd(fd, size)
    except OSError as exc:
        raise StageError(f"cannot read {what} {path!r}: {exc.strerror}") from None
    finally:
        _os.close(fd)
    return loads(raw, f"{what} {path!r}")


def loads(raw, what):
    """Parse the JSON *raw*; a repeated key, bad UTF-8 or bad JSON is one line."""
    import json

    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{key!r} appears twice")
            seen[key] = value
        return seen

    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StageError(f"{what} is no valid JSON: {first}") from None


# -- the header --------------------------------------------------------------------


class Header:
    """One file's tensors: name → (dtype, shape, start, end) in the file."""

    def __init__(self, name, tensors, metadata, size):
        self.name, self.tensors, self.metadata = name, tensors, metadata
        self.size = size


def read_header(local, source):
    """Read and check the header of the file at *local* (named *source*)."""
    fd = _os.open(local, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW)
    try:
        size = _os.fstat(fd).st_size
        if size < 8:
            bad(source, f"it has {size} bytes, fewer than the 8 of its header's length")
        length = int.from_bytes(_os.pread(fd, 8, 0), "little")
        if length > min(MAX_HEADER, size - 8):
            bad(
                source,
                f"its header claims {length} bytes, but the file has {size - 8} "
                f"after the length (and a header holds {MAX_HEADER} at most)",
            )
        raw = pread_all(fd, length, 8)
    finally:
        _os.close(fd)
    header = loads(raw, f"the header of {source!r}")
    return check_header(header, source, 8 + length, size)


def pread_all(fd, length, offset):
    """Read *length* bytes at *offset* (the file is on a RAM disk: no short reads)."""
    chunks, done = [], 0
    while done < length:
        chunk = _os.pread(fd, length - done, offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def check_header(header, source, start, size):
    """Check the parsed *header*; return the file's :class:`Header`."""
    if not isinstance(header, dict):
        bad(source, "its header is no JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        bad(source, "its __metadata__ is not a map of strings to strings")
    tensors = {name: entry(name, info, source, start) for name, info in header.items()}
    check_spans(tensors, source, start, size)
    return Header(_os.path.basename(source), tensors, metadata, size)


def entry(name, info, source, start):
    """Check one tensor's entry; return (dtype, shape, start, end) in the file."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        bad(source, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
        bad(source, f"tensor {name!r} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(whole(n) for n in shape):
        bad(source, f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(whole(n) for n in offsets)
    ):
        bad(source, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    count = 1
    for n in shape:
        count *= n
    bits, need = DTYPES[dtype][0], offsets[1] - offsets[0]
    if offsets[1] < offsets[0] or count * bits != need * 8:
        bad(
            source,
            f"tensor {name!r} has data_offsets {offsets!r}, but shape {shape!r} "
            f"of {dtype} needs {count * bits / 8:g} bytes",
        )
    return dtype, tuple(shape), start + offsets[0], start + offsets[1]


def whole(n):
    """Whether *n* is a whole number >= 0 (JSON's, not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def check_spans(tensors, source, start, size):
    """Refuse offsets past the data, overlapping ones and unused bytes.

    Offsets count from the first byte after the header (*start*), as the
    format writes them; so do the messages.
    """
    done, last, data = 0, None, size - start
    for name, (_, _, lo, hi) in sorted(tensors.items(), key=lambda t: t[1][2:]):
        lo, hi = lo - start, hi - start
        if hi > data:
            bad(
                source,
                f"tensor {name!r} has data_offsets [{lo}, {hi}], past the {data} "
                "bytes of data",
            )
        if lo < done:
            bad(source, f"tensors {last!r} and {name!r} overlap")
        if lo > done:
            bad(source, f"bytes {done} to {lo} of its data belong to no tensor")
        done, last = hi, name
    if done != data:
        bad(source, f"bytes {done} to {data} of its data belong to no tensor")


def bad(source, why):
    """Raise: *source* is no valid safetensors file, because *why*."""
    raise StageError(f"{source!r} is no valid safetensors file: {why}")


def headers(local, plan, tree_path):
    """Rank 0: the checked headers of the staged files, and the index against them.

    *local* is the node-local copy of *tree_path* (a file, or the directory
    of the shards).
    """
    if plan.names is None:
        return [read_header(local, tree_path)]
    found = [read_header(f"{local}/{n}", f"{tree_path}/{n}") for n in plan.names]
    check_index(found, plan, tree_path)
    return found


def check_index(found, plan, folder):
    """Each tensor in one file only; each the index names, in the file it names."""
    owner = {}
    for header in found:
        for name in header.tensors:
            if name in owner:
                raise StageError(
                    f"checkpoint {folder!r}: tensor {name!r} is in both "
                    f"{owner[name]!r} and {header.name!r}"
                )
            owner[name] = header.name
    for name, shard in (plan.weight_map or {}).items():
        if owner.get(name) != shard:
            raise StageError(
                f"checkpoint {folder!r}: the index puts tensor {name!r} in "
                f"{shard!r}, which does not hold it"
            )


# -- the arrays ----------------------------------------------------------------------


def types(found, framework):
    """Return {safetensors dtype: the framework's type} for the dtypes in *found*."""
    used = {t[0] for header in found for t in header.tensors.values()}
    return {name: array_type(name, framework) for name in sorted(used)}


def array_type(name, framework):
    """The numpy dtype or torch dtype of the safetensors dtype *name*."""
    _, numpy_name, torch_name = DTYPES[name]
    if framework == "pt":
        try:
            import torch
        except ImportError:
            raise StageError(
                "framework='pt' needs torch, which is not installed"
            ) from None
        found = getattr(torch, torch_name, None) if torch_name else None
        if found is None:
            raise StageError(
                f"dtype {name} has no torch dtype in torch {torch.__version__}"
            )
        return found
    import numpy

    if numpy_name is None:
        raise StageError(
            f"dtype {name} (packed values below a byte) has no numpy dtype"
        )
    if numpy_name.startswith("ml_dtypes."):
        try:
            import ml_dtypes
        except ImportError:
            raise StageError(
                f"dtype {name} needs ml_dtypes with numpy (pip install ml_dtypes), "
                "or framework='pt'"
            ) from None
        return numpy.dtype(getattr(ml_dtypes, numpy_name.split(".")[1]))
    return numpy.dtype(numpy_name)


def map_all(local, plan, found, framework):
    """Every rank: map each staged file once; return {name: array or tensor}."""
    kinds = types(found, framework)
    out = {}
    for header in found:
        path = local if plan.names is None else f"{local}/{header.name}"
        memory = map_file(path, framework)
        for name, (dtype, shape, lo, hi) in header.tensors.items():
            out[name] = view(memory, kinds[dtype], shape, lo, hi, framework)
    return out


def map_file(path, framework):
    """Map the file *path* whole: read-only for numpy, copy-on-write for torch."""
    import mmap

    fd = _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW)
    try:
        access = mmap.ACCESS_COPY if framework == "pt" else mmap.ACCESS_READ
        return mmap.mmap(fd, 0, access=access)
    finally:
        _os.close(fd)


def view(memory, kind, shape, lo, hi, framework):
    """The tensor of *shape* over the bytes [lo, hi) of *memory*; no copy."""
    count = 1
    for n in shape:
        count *= n
    if framework == "pt":
        import torch

        if not count:
            return torch.empty(shape, dtype=kind)
        flat = torch.frombuffer(memory, dtype=kind, count=count, offset=lo)
        return flat.reshape(shape)
    import numpy

    if not count:
        empty = numpy.empty(shape, kind)
        empty.flags.writeable = False
        return empty
    return numpy.frombuffer(memory, kind, count, lo).reshape(shape)


class Tensors(dict):
    """The tensors of a safetensors file or checkpoint: name → array (or tensor).

    A ``dict``: ``model.load_state_dict(t)``, ``t["w"]``, ``len(t)`` work.
    Each value views its file's map on this node's copy (no copy per rank).
    :attr:`metadata` holds each file's ``__metadata__`` by file name,
    :attr:`index` the index's own ``metadata`` (``None`` without an index),
    :attr:`seconds` this rank's time in each step. The copy's names are
    gone already: a value stays valid as long as it is held, and the
    memory goes with the last one on the node. :meth:`close` (and the end
    of ``with``) drops this object's references, on this rank alone.
    """

    def __init__(self, found, metadata, index, seconds):
        super().__init__(found)
        self.metadata, self.index, self.seconds = metadata, index, seconds
        self.closed = False

    def close(self):
        """Drop the references to the tensors; arrays taken from it stay valid."""
        self.clear()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(comm, path, framework):
    """Stage, check and map the checkpoint at *path* on every rank (collective)."""
    import time

    from mpistage.data.dirs import fspath, stage_agreed
    from mpistage.data.steps import same_everywhere
    from mpistage.runtime.broadcast import share
    from mpistage.runtime.collective import attempt

    path = attempt(comm, fspath, path)
    attempt(comm, check_framework, framework)
    given = (("path", repr(path)), ("framework", repr(framework)))
    attempt(comm, same_everywhere, comm, given)
    first = comm.rank == 0
    found = share(comm, attempt(comm, lambda: plan(path) if first else None))
    copy = stage_agreed(comm, found.path, names=found.names)
    try:
        begun = time.perf_counter()

        def rank0():
            return headers(copy.path, found, path) if first else None

        parsed = share(comm, attempt(comm, rank0))
        tensors = attempt(comm, map_all, copy.path, found, parsed, framework)
        mapped = time.perf_counter() - begun
    finally:
        copy.close()  # every rank has mapped (or failed): the names go
    metadata = {header.name: header.metadata for header in parsed}
    seconds = dict(copy.seconds, map=mapped)
    return Tensors(tensors, metadata, found.index, seconds)
