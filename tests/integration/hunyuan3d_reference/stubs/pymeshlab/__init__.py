"""Stand-in: the reference's postprocessors name `pymeshlab.MeshSet` in annotations at import; the shape test never
runs them."""


class MeshSet:
    """Never instantiated by the test."""
