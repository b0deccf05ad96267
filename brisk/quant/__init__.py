"""Low-bit weights: the formats (formats.py), the layers that hold them (modules.py) and the
conversion of a loaded model (`quantize_model`). The kernels that read them are kernels/quant.h."""
