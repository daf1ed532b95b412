"""A minimal safetensors reader/writer (numpy only), used by the PyTorch reference to write test
fixtures and by the tests to read the trainers' state dumps.

What it teaches: safetensors is about the simplest self-describing tensor container there is, which
is why it suits a C++ trainer that must dump state without any library:

    [8 bytes]  N, the header length, uint64 little-endian
    [N bytes]  a JSON object, UTF-8:
                 {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                  ...,
                  "__metadata__": {"key": "value", ...}}        (values must be strings)
    [rest]     the raw tensor bytes, row-major, little-endian; data_offsets are byte offsets
               into this region, measured from its start (not from the start of the file)

Trade-off: no compression and no streaming, but a reader can mmap or seek straight to a tensor,
and a writer needs only printf and fwrite. We pad the JSON with spaces to a multiple of 8 bytes so
that the data region starts 8-byte aligned (readers must not rely on that: files from other
writers may not pad).
"""
import json
import struct

import numpy as np

# The dtypes this project uses; the safetensors names are fixed by the format.
DTYPES = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U16": np.dtype("<u2"),
}


def _safetensors_dtype_name(array):
    for name, dtype in DTYPES.items():
        if array.dtype == dtype or array.dtype == dtype.newbyteorder("="):
            return name
    raise ValueError(f"safetensors_io: unsupported dtype {array.dtype}")


def write_safetensors(path, tensors, metadata=None):
    """Write a dict {name: numpy array} (insertion order = data order) and a dict of strings."""
    header = {}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype_name = _safetensors_dtype_name(array)
        array = array.astype(DTYPES[dtype_name], copy=False)  # make it little-endian
        header[name] = {"dtype": dtype_name, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for array in arrays:
            # tofile writes the buffer directly: no second copy of a 500 MB gradient
            array.tofile(f)


def read_safetensors_header(path):
    """Return (header dict without __metadata__, metadata dict, byte offset of the data region)."""
    with open(path, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (header_length,) = struct.unpack("<Q", raw_length)
        if header_length > 100_000_000:
            raise ValueError(f"{path}: implausible header length {header_length}")
        header = json.loads(f.read(header_length).decode("utf-8"))
    metadata = header.pop("__metadata__", {}) or {}
    return header, metadata, 8 + header_length


def read_safetensors(path, names=None):
    """Return ({name: numpy array}, metadata). `names` limits which tensors are read."""
    header, metadata, data_start = read_safetensors_header(path)
    tensors = {}
    with open(path, "rb") as f:
        f.seek(0, 2)
        file_size = f.tell()
        for name, info in header.items():
            if names is not None and name not in names:
                continue
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
            dtype = DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * dtype.itemsize or data_start + end > file_size:
                raise ValueError(f"{path}: tensor {name}: data_offsets {begin}..{end} do not fit "
                                 f"shape {list(shape)} {info['dtype']} in a {file_size}-byte file")
            f.seek(data_start + begin)
            tensors[name] = np.fromfile(f, dtype=dtype, count=count).reshape(shape)
    return tensors, metadata
