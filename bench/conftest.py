import dspark_fn  # noqa: F401  first, before any benchmark loads mlx: OpenBLAS then serves MLX (blas.py)

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
