"""PLACEHOLDER — to be written (Ascend accuracy standards)."""


def compare(*args, **kwargs):
    raise NotImplementedError("compare")
