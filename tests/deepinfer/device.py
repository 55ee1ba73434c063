"""Where the DeepInfer engine tests run: the CPU, or the device `WEIR_TEST_DEVICE` names (`cuda`,
`cuda:1`) on a machine with a GPU. Float32 on either, so the comparisons with transformers (on
the CPU) keep their tolerances; bfloat16 has tests of its own."""

from __future__ import annotations

import os

DEVICE = os.environ.get("WEIR_TEST_DEVICE", "cpu")
DTYPE = "float32"
