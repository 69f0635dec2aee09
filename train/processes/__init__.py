"""A job's processes: the process group and its collectives, hangs named, signals, how a job ends."""
