"""The repository itself: the docs' commands run as written, the floor plan, the suite's markers."""
