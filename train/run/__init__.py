"""The training loop: ``python -m train``'s job (``app``), its engine and step, the checks run first."""
