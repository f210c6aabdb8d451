"""Package data: the quantization presets (YAML) and the tiny model config of the demo (installed as
``modelopt_moe.configs``)."""
