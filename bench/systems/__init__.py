"""One small file per system compared by bench/compare.py; each exposes `build(rank, world, spec)`."""
