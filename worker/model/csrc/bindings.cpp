// The Python module: one entry per kernel (declared in kernels.h).
// pybind11 with torch's tensor casters, not torch/extension.h (which brings the whole C++ API into the build).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("prefill_attention_supported", &prefill_attention_supported, "whether the prefill kernel takes this head_dim");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prompt chunks over their cached context, K/V read through the block tables (CPU, float32)");
  m.def("rotary_and_write_kv", &rotary_and_write_kv,
        "rotary embedding on q and k in place in qkv, K/V written to their slots (CPU, float32)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (CPU, float32)");
  m.def("finite_choices", &finite_choices,
        "each row's token id as a list, 0 where its logit is not finite (CPU, float32 logits)");
  m.def("sample_rows", &sample_rows,
        "each row's token drawn by its uniform from its temperature-scaled, top-k / top-p / min-p filtered "
        "distribution (CPU, float32 logits)");
  m.def("repetition_penalty_rows", &repetition_penalty_rows,
        "the repetition penalty in place on the given rows; an id outside the vocabulary is returned, nothing changed");
  m.def("presence_frequency_rows", &presence_frequency_rows,
        "OpenAI's presence and frequency penalties in place on the given rows; an id outside the vocabulary is "
        "returned, nothing changed");
  m.def("rms_norm", &rms_norm, "RMSNorm into out (CPU, float32)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) into out (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up into out (CPU, float32)");
  m.def("head_rms_norm", &head_rms_norm, "per-head RMSNorm of the q and k heads in place in qkv (CPU, float32)");
  m.def("linear_packed", &linear_packed,
        "out = x @ weight.T with the weight in 16-feature panels, float32, bfloat16 or float16 (CPU, float32 x and out)");
  m.def("linear_small_batch_int8", &linear_small_batch_int8, "out = x @ dequant(int8 weight).T for few rows");
  m.def("int8_weight_panel_group", &int8_weight_panel_group,
        "weight-only INT8 panels per interleaved group the int8 panel kernels read best (1: plain panels)");
  m.def("decoder_layers", &decoder_layers, py::call_guard<py::gil_scoped_release>(),
        "a step's model up to the head in one call (embedding lookup, every decoder layer: norms, projections, "
        "rotary + KV write, paged attention, gated MLP; the final norm): the final hidden states (CPU, float32)");
  m.def("linear_small_batch_int4", &linear_small_batch_int4, "out = x @ dequant(int4 weight).T for few rows");
  m.def("int4_weight_tiles_supported", &int4_weight_tiles_supported,
        "whether this build's linear_small_batch_int4 takes held INT4 tiles for weights of this K and group size");
  m.def("int4_row_kernel", &int4_row_kernel, py::arg("choice") = "",
        "the tile a single row of x takes by INT4 weights, \"bf16\" or \"fma\"; given \"auto\" (by the CPU's "
        "vendor), \"bf16\" or \"fma\", chooses it first");
  m.def("int8_activations_supported", &int8_activations_supported,
        "whether a layer of this in_features and group size takes the int8-activation kernels");
  m.def("int8_activations_output_major", &int8_activations_output_major,
        "whether the int8-activation kernels take output-major panels and group columns (the AVX-512 VNNI kernels)");
  m.def("int8_activation_group_columns", &int8_activation_group_columns, py::arg("scales"),
        py::arg("zeros") = py::none(),
        "scales [N] or [N, G] (and zeros) -> [ceil(N / 8), G, 2, 8]: per run of 8 rows and group, their scales then zeros");
  m.def("linear_int8_weights_int8_activations", &linear_int8_weights_int8_activations,
        "out = x @ dequant(int8 weight panels).T with x quantized per 32-block to int8, integer block dots");
  m.def("linear_int4_weights_int8_activations", &linear_int4_weights_int8_activations,
        "out = x @ dequant(int4 weight panels).T with x quantized per 32-block to int8, integer block dots");
}
