// The torch headers of the extension's torch-facing code: ATen, pybind11 with torch's type
// casters, and the THPVariable / dtype bridges. Not <torch/extension.h>: that adds torch's whole
// C++ frontend (nn, optim, data, jit), which nothing here uses, and nearly doubles the time to
// parse each translation unit (g++ -fsyntax-only: 19.4 s against 10.5 s), paid by the build and
// again by `make glue-check` for every torch-facing file.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
