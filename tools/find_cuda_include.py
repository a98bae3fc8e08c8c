"""Print the directory that holds cuda.h, for meson.build.

The header comes from the nvidia-cuda-runtime wheel, so no CUDA toolkit is needed to build pyalloc.
sys.path is scanned first because, under pip's isolated build, cuda.pathfinder looks at the user's
site-packages rather than pip's temporary build environment: it then finds no header, a system
toolkit's, or a mismatched one from the user's venv. Pathfinder is only the fallback (conda,
CUDA_HOME, a system toolkit).
"""
import os
import sys

for base in sys.path:
    d = os.path.join(base or ".", "nvidia", "cu13", "include")
    if os.path.isfile(os.path.join(d, "cuda.h")):
        print(os.path.abspath(d))
        sys.exit(0)
try:
    import cuda.pathfinder as pathfinder

    d = pathfinder.find_nvidia_header_directory("cudart")
    if d and os.path.isfile(os.path.join(d, "cuda.h")):
        print(d)
        sys.exit(0)
except Exception as exc:  # pathfinder missing or failing: say so below
    print(f"cuda.pathfinder fallback failed: {exc!r}", file=sys.stderr)
sys.exit("cuda.h not found: pip install 'nvidia-cuda-runtime>=13.4,<14'")
