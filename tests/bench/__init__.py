"""The benchmark scripts' logic (bench/) on the CPU."""
