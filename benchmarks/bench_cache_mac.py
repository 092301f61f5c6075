"""What sealing a cache entry costs: the CRC-32 every blob carries vs the HMAC that authenticates it.

Sizes are those of ``k3-tiny``'s entries (docs/cache.md): a KDA checkpoint of ~0.5 MB and an MLA
block of ~20 KB. For each: CRC-32 (``zlib``), HMAC-SHA256 (what :class:`cache_service.EntryMac`
uses, over the entry's Redis key then the blob) and keyed blake2b-256 (the alternative). Best of 5
runs of 200 calls, one thread.

    .venv/bin/python benchmarks/bench_cache_mac.py
"""

import hashlib
import sys
import timeit
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_service.codec import EntryMac  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cache_mac.py"
SIZES = {"KDA checkpoint 0.5 MB": 512 * 1024, "MLA block 20 KB": 20 * 1024}
KEY = bytes(range(32))
ENTRY_KEY = "ds:v1:t:acme:kda:" + "0" * 32


def blake2b_keyed(blob: bytes) -> bytes:
    h = hashlib.blake2b(key=KEY, digest_size=32)
    h.update(ENTRY_KEY.encode())
    h.update(blob)
    return h.digest()


def best_us(fn, number: int = 200, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    print(f"# {COMMAND}")
    mac = EntryMac(KEY)
    for name, n in SIZES.items():
        blob = bytes(range(256)) * (n // 256)
        sealed = mac.seal(ENTRY_KEY, blob)
        rows = {
            "crc32": best_us(lambda: zlib.crc32(blob)),
            "hmac-sha256 (seal)": best_us(lambda: mac.seal(ENTRY_KEY, blob)),
            "hmac-sha256 (open)": best_us(lambda: mac.open(ENTRY_KEY, sealed)),
            "blake2b-256 keyed": best_us(lambda: blake2b_keyed(blob)),
        }
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
