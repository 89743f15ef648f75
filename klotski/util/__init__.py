"""Small things every room uses: atomic and checked writes (`writes`), the user cache and
its paths (`cachedir`), the one dtype table (`dtypes`) and the one streaming safetensors
writer (`safetensors`). Imports nothing from the other rooms."""
