"""Benchmark: what a persistent compilation cache saves, program by program.

    python benchmarks/cache_load.py DIR            # a cache a run wrote (--compilation-cache DIR)
    python benchmarks/cache_load.py DIR --top 5    # the five programs that took longest to compile

For every entry of the cache (largest compile time first): the time its compilation took
when the entry was written (jax stores it with the entry, in whole seconds), the time this
process takes to read and load it (decompress, then the backend's deserialization: what a
second run pays instead of compiling), and the entry's size. A program whose load takes
about as long as its compile gains nothing from the cache.

The loading is done the way jax does it on a cache hit (`jax._src.compilation_cache`; a
private module, so a newer jax may move it: the script then says so). Loaded programs are
not run. Entries written by another jax, jaxlib or machine may fail to load: they are
listed as such. Times depend on the machine's load: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import print_markdown  # noqa: E402


def entries(directory: str) -> list:
    names = [n for n in os.listdir(directory) if n.endswith("-cache")]
    if not names:
        raise SystemExit(f"cache_load: no compilation cache entries (*-cache files) in {directory}")
    return sorted(names)


def load_times(directory: str, names: list) -> list:
    import jax

    try:
        from jax._src import compilation_cache as cache
        from jax._src import xla_bridge
        from jax._src.lib import xla_client
    except ImportError as err:  # a private module: name what moved
        raise SystemExit(f"cache_load: this jax ({jax.__version__}) moved its cache internals: {err}") from None
    backend = xla_bridge.get_backend()
    devices = xla_client.DeviceList(tuple(jax.devices()[:1]))
    rows = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            raw = f.read()
        start = time.perf_counter()
        serialized, compiled_s = cache.extract_executable_and_time(cache.decompress_executable(raw))
        try:
            backend.deserialize_executable(serialized, devices, None)
            loaded_s, note = time.perf_counter() - start, ""
        except Exception as err:  # noqa: BLE001 - reported per entry, the others still load
            loaded_s, note = float("nan"), f"not loaded: {str(err).splitlines()[0][:80]}"
        rows.append(dict(program=name.rsplit("-", 2)[0], compiled_s=compiled_s, loaded_s=loaded_s,
                         mb=len(raw) / 2**20, note=note))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a persistent compilation cache directory")
    parser.add_argument("--top", type=int, default=0, help="only the N programs that took longest to compile")
    args = parser.parse_args(argv)
    names = entries(args.directory)
    rows = load_times(args.directory, names)
    rows.sort(key=lambda r: (-r["compiled_s"], r["program"]))
    if args.top:
        rows = rows[:args.top]
    import jax

    print(f"## {args.directory}: {len(names)} entries, jax {jax.__version__} on {jax.default_backend()}\n")
    table = [[r["program"], f"{r['compiled_s']:d}", f"{r['loaded_s']:.2f}",
              f"{r['loaded_s'] / r['compiled_s']:.2f}" if r["compiled_s"] >= 1 else "",
              f"{r['mb']:.2f}", r["note"]] for r in rows]
    total_c, total_l = sum(r["compiled_s"] for r in rows), sum(r["loaded_s"] for r in rows)
    table.append(["all listed", f"{total_c:d}", f"{total_l:.2f}", "", f"{sum(r['mb'] for r in rows):.2f}", ""])
    print_markdown(["program", "compiled (s, whole)", "loaded (s)", "load / compile", "MiB on disk", ""], table)


if __name__ == "__main__":
    main()
