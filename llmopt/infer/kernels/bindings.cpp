// Python bindings of the fused CPU kernels (built by llmopt/infer/fast/build.py). Classes are
// module-local: the native and the portable build can be loaded in one process.
#include <torch/extension.h>

#include "model.h"

namespace {

using llmopt::Layer;
using llmopt::Linear;
using llmopt::Model;
using llmopt::ModelShape;

// y = x W^T + b for x [K] or [N, K] float32 (tests and benchmarks call single linears).
at::Tensor linear_call(const Linear& l, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && (x.dim() == 1 || x.dim() == 2) &&
                  x.size(-1) == l.k,
              "x must be float32 [", l.k, "] or [N, ", l.k, "], got ", x.sizes());
  auto xc = x.contiguous();
  const int64_t n_tok = x.dim() == 1 ? 1 : x.size(0);
  auto y = at::empty(x.dim() == 1 ? std::vector<int64_t>{l.n} : std::vector<int64_t>{n_tok, l.n},
                     xc.options());
  llmopt::QRows q;
  if (l.kind == llmopt::CODED) llmopt::quantize_rows(xc.data_ptr<float>(), n_tok, l.k, q);
  llmopt::linear_rows(l, xc.data_ptr<float>(), &q, n_tok, y.data_ptr<float>(), l.n);
  return y;
}

at::Tensor weight_row_call(const Linear& l, int64_t row) {
  auto out = at::empty({l.k}, at::TensorOptions().dtype(at::kFloat));
  llmopt::weight_row(l, row, out.data_ptr<float>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("HAS_AVX512_VNNI") = py::bool_(
#ifdef LLMOPT_AVX512
      true
#else
      false
#endif
  );
  m.attr("SIMD") = py::str(
#if defined(LLMOPT_AVX512)
      "avx512-vnni"
#elif defined(LLMOPT_AVX2)
      "avx2"
#else
      "scalar"
#endif
  );
  py::register_local_exception<llmopt::StepError>(m, "StepError", PyExc_ValueError);
  py::class_<Linear>(m, "Linear", py::module_local())
      .def_readonly("kind", &Linear::kind)
      .def_readonly("out_features", &Linear::n)
      .def_readonly("in_features", &Linear::k)
      .def_property_readonly("nbytes", &Linear::nbytes)
      .def("row", &weight_row_call)
      .def("__call__", &linear_call, py::call_guard<py::gil_scoped_release>());
  m.def("make_float_linear", &llmopt::make_float_linear, py::arg("w"), py::arg("bias"));
  m.def("make_coded_linear", &llmopt::make_coded_linear, py::arg("n"), py::arg("k"),
        py::arg("bits"), py::arg("group"), py::arg("codes"), py::arg("scales"), py::arg("mins"),
        py::arg("zero"), py::arg("bias"), py::arg("super_scales") = py::none(),
        py::arg("super_mins") = py::none());
  py::class_<ModelShape>(m, "ModelShape", py::module_local())
      .def(py::init<>())
      .def_readwrite("hidden", &ModelShape::hidden)
      .def_readwrite("heads", &ModelShape::heads)
      .def_readwrite("kv_heads", &ModelShape::kv_heads)
      .def_readwrite("head_dim", &ModelShape::head_dim)
      .def_readwrite("inter", &ModelShape::inter)
      .def_readwrite("vocab", &ModelShape::vocab)
      .def_readwrite("eps", &ModelShape::eps)
      .def_readwrite("sandwich", &ModelShape::sandwich)
      .def_readwrite("ffn", &ModelShape::ffn)
      .def_readwrite("embed_scale", &ModelShape::embed_scale)
      .def_readwrite("attn_scale", &ModelShape::attn_scale)
      .def_readwrite("attn_softcap", &ModelShape::attn_softcap)
      .def_readwrite("final_softcap", &ModelShape::final_softcap);
  py::class_<Layer>(m, "Layer", py::module_local())
      .def(py::init<>())
      .def_readwrite("norms", &Layer::norms)
      .def_readwrite("q_norm", &Layer::q_norm)
      .def_readwrite("k_norm", &Layer::k_norm)
      .def_readwrite("qkv", &Layer::qkv)
      .def_readwrite("o", &Layer::o)
      .def_readwrite("up", &Layer::up)
      .def_readwrite("down", &Layer::down)
      .def_readwrite("window", &Layer::window);
  py::class_<Model>(m, "Model", py::module_local())
      .def(py::init<ModelShape, Linear, std::vector<Layer>, at::Tensor, std::vector<Linear>,
                    at::Tensor, at::Tensor>())
      .def("forward", &Model::forward, py::arg("tokens"), py::arg("positions"), py::arg("slots"),
           py::arg("query_start"), py::arg("seq_lens"), py::arg("block_tables"),
           py::arg("logits_rows"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_size"),
           py::arg("threads") = 0, py::arg("parents") = py::none(), py::arg("hidden") = py::none(),
           py::arg("inputs") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("weight_bytes", &Model::weight_bytes)
      .def_property_readonly("num_layers", &Model::num_layers);
}
