"""`python -m tandem.native`: build (or find built) the native CPU kernels now, as `make setup` does, so no engine
pays the build at run time."""

from __future__ import annotations

import time

from tandem import native


def main() -> int:
    start = time.perf_counter()
    ok = native.enabled()  # float32 is always served: this builds and loads the extension
    took = time.perf_counter() - start
    if ok:
        print(f"tandem: native CPU kernels {native.build_name()} ready ({took:.1f} s)")
    else:
        print("tandem: native CPU kernels unavailable; the engine uses the PyTorch paths (see the warning above)")
    return 0  # the PyTorch paths serve without them: never fail an install over it


if __name__ == "__main__":
    raise SystemExit(main())
