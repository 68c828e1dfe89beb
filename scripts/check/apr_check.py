#!/usr/bin/env python3
"""Independent checker for APR v2 files (aprender's container format) as kiln writes them.

Standard library only. Written from the format description in docs/formats.md §6.2, not
from kiln's Rust reader, so the two can check each other.

    python3 scripts/check/apr_check.py FILE [FILE ...] [-v]

Checks, for each (uncompressed) file: magic ("APR\\0" or legacy "APR2"), version 2.x, the
header CRC32 (bytes 0..40 and 44..64), the trailing CRC32 (every byte before the last four),
the section order, that the metadata is a JSON object, and that the tensor index is
strictly sorted by name, with every tensor's offset 64-byte aligned, inside the data
section, not overlapping another, and its size equal to dtype x dims for the known dtypes.
Prints a summary per file and exits 1 if any check failed (2 for a usage problem or a
compressed file, which needs a codec the standard library lacks).
"""

import json
import struct
import sys
import zlib

HEADER = 64
ALIGN = 64
FLAG_NAMES = {
    0x0001: "LZ4",
    0x0002: "ZSTD",
    0x0004: "ENCRYPTED",
    0x0008: "SIGNED",
    0x0010: "SHARDED",
    0x0020: "QUANTIZED",
    0x0040: "HAS_FILTERBANK",
    0x0080: "HAS_MODEL_CARD",
    0x0100: "STREAMING",
    0x0200: "HAS_VOCAB",
    0x0400: "ROW_MAJOR",
    0x0800: "COLUMN_MAJOR",
}


def _per_element(width):
    return lambda n: n * width


def _blocks(block, nbytes):
    return lambda n: None if n % block else n // block * nbytes


def _apr_q8(n):
    return 0 if n == 0 else 4 + n


def _apr_q4(n):
    return (n + 31) // 32 * 18


# id -> (name, bytes for n values or None when impossible)
DTYPES = {
    0: ("f32", _per_element(4)),
    1: ("f16", _per_element(2)),
    2: ("q4_0", _blocks(32, 18)),
    3: ("f64", _per_element(8)),
    4: ("i32", _per_element(4)),
    5: ("i64", _per_element(8)),
    6: ("i8", _per_element(1)),
    7: ("u8", _per_element(1)),
    8: ("q8_0", _blocks(32, 34)),
    10: ("q2_k", _blocks(256, 84)),
    11: ("q3_k", _blocks(256, 110)),
    12: ("q4_k", _blocks(256, 144)),
    13: ("q5_k", _blocks(256, 176)),
    14: ("q6_k", _blocks(256, 210)),
    30: ("bf16", _per_element(2)),
    128: ("apr_q4", _apr_q4),
    129: ("apr_q8", _apr_q8),
}


class Checker:
    def __init__(self, path, verbose):
        self.path = path
        self.verbose = verbose
        self.errors = []
        self.notes = []

    def fail(self, msg):
        self.errors.append(msg)

    def run(self):
        rc = self._run()
        status = "OK" if not self.errors else "FAIL"
        print(f"{self.path}: {status}: {self.summary}")
        for n in self.notes:
            print(n)
        for e in self.errors:
            print(f"  error: {e}")
        return rc if rc else (1 if self.errors else 0)

    def _run(self):
        self.summary = "not an APR v2 file"
        try:
            with open(self.path, "rb") as f:
                b = f.read()
        except OSError as e:
            self.fail(f"cannot read: {e}")
            return 1
        if len(b) < HEADER + 4:
            self.fail(f"file is {len(b)} bytes; a header and checksum need {HEADER + 4}")
            return 1
        magic = b[0:4]
        if magic not in (b"APR\x00", b"APR2"):
            self.fail(f"bad magic {magic!r}")
            return 1
        major, minor, flags, count = struct.unpack_from("<BBHI", b, 4)
        meta_off, meta_size, index_off, data_off, crc = struct.unpack_from("<QIQQI", b, 12)
        if major != 2:
            self.fail(f"version {major}.{minor}, expected 2.x")
        want = zlib.crc32(b[0:40] + b[44:64]) & 0xFFFFFFFF
        if want != crc:
            self.fail(f"header CRC {crc:#010x} != computed {want:#010x}")
        names = [n for bit, n in sorted(FLAG_NAMES.items()) if flags & bit]
        self.summary = f"APR v{major}.{minor}, flags {flags:#06x} [{' '.join(names)}], {count} tensors"
        unknown = flags & ~sum(FLAG_NAMES)
        if unknown:
            self.fail(f"unknown flag bits {unknown:#06x}")
        if flags & 0x3:
            # Compressed only if the payload starts with the codec's frame magic; aprender's
            # writer sets the LZ4 flag over an uncompressed payload.
            if b[64:68] in (b"\x28\xb5\x2f\xfd", b"\x04\x22\x4d\x18"):
                self.fail("compressed file (LZ4/ZSTD): this checker reads uncompressed files only")
                return 2
            self.notes.append("  compression flag set over an uncompressed payload")
        stored = struct.unpack_from("<I", b, len(b) - 4)[0]
        want = zlib.crc32(b[:-4]) & 0xFFFFFFFF
        if want != stored:
            self.fail(f"trailing CRC {stored:#010x} != computed {want:#010x}")
        payload_end = len(b) - 4

        if not (HEADER <= meta_off and meta_off + meta_size <= index_off <= data_off <= payload_end):
            self.fail(
                f"sections out of order: metadata {meta_off}+{meta_size}, index {index_off}, "
                f"data {data_off}, payload end {payload_end}"
            )
            return 1
        if data_off % ALIGN:
            self.fail(f"data_offset {data_off} not {ALIGN}-byte aligned")

        try:
            meta = json.loads(b[meta_off : meta_off + meta_size].decode("utf-8"))
            if not isinstance(meta, dict):
                self.fail(f"metadata is a JSON {type(meta).__name__}, expected an object")
            else:
                self.notes.append(f"  metadata: {len(meta)} keys")
        except (UnicodeDecodeError, ValueError) as e:
            self.fail(f"metadata is not valid JSON: {e}")

        tensors = self.parse_index(b, index_off, data_off, count)
        data_len = payload_end - data_off
        spans = []
        for name, dtype, dims, off, size in tensors:
            label = name.decode("utf-8", "replace")
            if off % ALIGN:
                self.fail(f"tensor {label!r}: offset {off} not {ALIGN}-byte aligned")
            if off + size > data_len:
                self.fail(f"tensor {label!r}: {off}+{size} outside the {data_len}-byte data section")
            n = 1
            for d in dims:
                n *= d
            if n >= 1 << 64:
                self.fail(f"tensor {label!r}: dims {dims} overflow u64")
                continue
            if dtype not in DTYPES:
                self.fail(f"tensor {label!r}: unknown dtype id {dtype}")
                continue
            dname, sizer = DTYPES[dtype]
            expect = sizer(n)
            if expect is None:
                self.fail(f"tensor {label!r}: {n} values are not whole {dname} blocks")
            elif expect != size:
                self.fail(f"tensor {label!r}: size {size}, {n} x {dname} needs {expect}")
            if size:
                spans.append((off, off + size, label))
            if self.verbose:
                self.notes.append(f"  {label}: {dname} {dims} @{off} +{size}")
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                self.fail(f"tensors {n0!r} [{s0},{e0}) and {n1!r} [{s1},{e1}) overlap")
        self.notes.append(f"  data section: {data_len} bytes, {len(spans)} non-empty tensors")
        return 0

    def parse_index(self, b, start, end, count):
        pos, out, prev = start, [], None
        for i in range(count):
            if pos + 2 > end:
                self.fail(f"index entry {i} runs past data_offset")
                return out
            (nlen,) = struct.unpack_from("<H", b, pos)
            pos += 2
            if nlen == 0 or nlen > 256:
                self.fail(f"index entry {i}: name length {nlen}")
            if pos + nlen + 2 > end:
                self.fail(f"index entry {i} runs past data_offset")
                return out
            name = b[pos : pos + nlen]
            pos += nlen
            try:
                name.decode("utf-8")
            except UnicodeDecodeError:
                self.fail(f"index entry {i}: name is not UTF-8")
            dtype, ndim = b[pos], b[pos + 1]
            pos += 2
            if ndim > 8:
                self.fail(f"index entry {i}: {ndim} dims")
            if pos + 8 * ndim + 16 > end:
                self.fail(f"index entry {i} runs past data_offset")
                return out
            dims = list(struct.unpack_from(f"<{ndim}Q", b, pos))
            pos += 8 * ndim
            off, size = struct.unpack_from("<QQ", b, pos)
            pos += 16
            # Strict order of the raw UTF-8 bytes (what Rust's str ordering compares).
            if prev is not None and not prev < name:
                self.fail(f"index not strictly sorted: {name!r} after {prev!r}")
            prev = name
            out.append((name, dtype, dims, off, size))
        if any(b[pos:end]):
            self.fail(f"non-zero bytes between the last index entry ({pos}) and data_offset ({end})")
        return out


def main(argv):
    verbose = "-v" in argv
    paths = [a for a in argv if a != "-v"]
    if not paths:
        print("usage: apr_check.py FILE [FILE ...] [-v]", file=sys.stderr)
        return 2
    worst = 0
    for p in paths:
        worst = max(worst, Checker(p, verbose).run())
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
