"""CuTe DSL kernels vs copy bandwidth, torch and FlashInfer (same as `layer-boundary bench cutedsl`).

Runs from a checkout without installing: it puts core/ and plugins/cutedsl/ on the path.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.join(HERE, "..", "core"), os.path.join(HERE, "..", "plugins", "cutedsl")):
    if os.path.isdir(path) and os.path.abspath(path) not in sys.path:
        sys.path.insert(0, os.path.abspath(path))

from layer_boundary_cutedsl.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
