"""Runtime modules that execute lattice weights directly (e.g. PyTorch's int4 kernels)."""
