"""The embedded demo model: the synthetic shapes it learned from and the script that trains it.

`shapes` renders the images and prompts (used by training and by the semantic test); `train` is the
reproducible training script (`python -m diffuserve.demo.train`). The trained checkpoint itself is
package data under `diffuserve/models/demo_flux/`, installed into the cache by
`diffuserve.models.tiny.ensure_default_model`.
"""
