"""float64 NumPy goldens with the device's roundings (the ``"reference"`` backend).

Pure functions over NumPy arrays; the backend table (:mod:`fastgrad.backends.reference`) names
them.  They are tested against the independent oracles in ``tests/naive.py``.
"""
