"""The GPU check's parts (bench/gpu_check.py): models from configs, measurements, capacity, figure."""
