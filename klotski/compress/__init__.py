"""Weights kept smaller than the compute dtype and decoded on the device before use: HQQ
4-bit (`hqq`), the quantized copy made once and its codec (`quantized`), gpt-oss's MXFP4
as shipped (`mxfp4`). Never reads a checkpoint itself: callers hand tensors in."""
