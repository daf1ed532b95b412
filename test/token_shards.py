"""llm.c's token shard format, written by the tests independently of llmc/formats.h.

A shard is a 256-int32 header (magic 20240520, version 1, token count, the rest zero) followed by
the tokens as uint16. docs/formats.md describes it; writing it here in a few lines of numpy, not
with our own C++ writer, keeps the tests an independent check of the trainers' reader.
"""
import numpy as np

SHARD_MAGIC, SHARD_VERSION = 20240520, 1


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())
