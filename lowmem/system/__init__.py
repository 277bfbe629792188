"""The platform: NumPy or CuPy (backend), the CUDA compile helper (cuda), the cores (threads),
free memory and how bytes print (memory), data parallelism (distributed), atomic files (atomic).
Imports nothing else of lowmem."""
