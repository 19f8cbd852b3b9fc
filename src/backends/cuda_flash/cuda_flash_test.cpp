// CUDA_FLASH on a GPU: mixed and split-KV batches against REFERENCE, fp8 K/V
// with queries past the f16 range, and CUDA graph capture of a decode step and
// a mixed step replayed with new metadata (a decode step also with a prefill
// plan).
// Skipped without a CUDA device; the full feature grid is the conformance
// suite (`pagedattn conformance --backend CUDA_FLASH`).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/metadata.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cuda_flash_backend.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 128;
constexpr int kBlockSize = 16;
constexpr int kNumBlocks = 700;
constexpr float kAtol = 1e-2f;
constexpr float kRtol = 1e-2f;

using Batch = std::vector<std::pair<int, int>>;  // (query_len, seq_len)

bool have_cuda() {
  BackendRegistry::instance();
  const DeviceAllocator* a = find_device_allocator(DeviceType::CUDA);
  return a != nullptr && a->device_count() > 0;
}

const AttentionBackend& backend(std::string_view name) {
  const AttentionBackend* b = BackendRegistry::instance().find(name);
  if (b == nullptr) throw Error(ErrorKind::Unsupported, fmt::format("backend {} not registered", name));
  return *b;
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// One shared cache and random, disjoint block lists per request.
struct Fixture {
  Tensor cache_cpu;  // [2, NB, BS, Hkv, D]
  Tensor cache_gpu;
  std::vector<std::int32_t> free_blocks;

  explicit Fixture(std::mt19937& rng, DType cache_dtype = DType::BF16) {
    const Dims shape{2, kNumBlocks, kBlockSize, kKvHeads, kHeadSize};
    cache_cpu = Tensor::from_floats(random_floats(2ull * kNumBlocks * kBlockSize * kKvHeads * kHeadSize, rng), shape,
                                    cache_dtype);
    cache_gpu = cache_cpu.to(Device::cuda());
    free_blocks.resize(kNumBlocks - 1);
    std::iota(free_blocks.begin(), free_blocks.end(), 1);  // block 0 is the null block
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  }

  std::vector<RequestSpec> specs(const Batch& batch) const {
    std::vector<RequestSpec> out;
    std::size_t next = 0;
    for (const auto& [q, s] : batch) {
      RequestSpec r{q, s, {}};
      const int blocks = (s + kBlockSize - 1) / kBlockSize;
      for (int b = 0; b < blocks; ++b) r.blocks.push_back(free_blocks.at(next++ % free_blocks.size()));
      out.push_back(std::move(r));
    }
    return out;
  }
};

AttentionImplParams impl_params(Device device, CacheDType kv_cache_dtype = CacheDType::Auto) {
  AttentionImplParams p;
  p.kv_cache_dtype = kv_cache_dtype;
  p.num_heads = kHeads;
  p.head_size = kHeadSize;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadSize));
  p.num_kv_heads = kKvHeads;
  p.dtype = DType::BF16;
  p.device = device;
  return p;
}

int num_tokens(const Batch& b) {
  int t = 0;
  for (const auto& r : b) t += r.first;
  return t;
}

// REFERENCE on the CPU: output [T, H, D] and LSE [H, T] as floats.
std::pair<std::vector<float>, std::vector<float>> reference_run(const Fixture& f, const Batch& batch,
                                                                const Tensor& query,
                                                                const AttentionImplParams& params,
                                                                const LayerQuantState& layer = {}) {
  const AttentionBackend& ref = backend("REFERENCE");
  auto impl = ref.make_impl(params);
  auto builder = ref.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cpu(), {}});
  const auto specs = f.specs(batch);
  const auto md = builder->build(make_common_metadata(specs, {kBlockSize, true, Device::cpu(), 0}));
  const int t = num_tokens(batch);
  Tensor out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16);
  Tensor lse = Tensor::zeros({kHeads, t}, DType::F32);
  impl->forward(layer, query, {}, {}, ref.unbind_kv_cache(f.cache_cpu), *md, out, lse);
  return {to_float_vector(out), to_float_vector(lse)};
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, std::string_view what) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = (std::isinf(want[i]) && got[i] == want[i]) ||
                    std::fabs(got[i] - want[i]) <= kAtol + kRtol * std::fabs(want[i]);
    if (!ok && ++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

class CudaFlashTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(CudaFlashTest, MixedAndSplitBatchesMatchReference) {
  std::mt19937 rng(3);
  const Fixture f(rng);
  const AttentionBackend& flash = backend(kCudaFlashBackendName);
  for (const Batch& batch : {Batch{{70, 300}, {1, 1000}, {3, 45}, {1, 1}, {130, 130}},  // mixed
                             Batch{{1, 5000}, {1, 2000}}}) {                             // split decode
    const int t = num_tokens(batch);
    const Tensor query = Tensor::from_floats(random_floats(static_cast<std::size_t>(t) * kHeads * kHeadSize, rng),
                                             {t, kHeads, kHeadSize}, DType::BF16);
    const auto [want_out, want_lse] = reference_run(f, batch, query, impl_params(Device::cpu()));
    auto impl = flash.make_impl(impl_params(Device::cuda()));
    auto builder = flash.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cuda(), {}, kHeads});
    const auto md = builder->build(make_common_metadata(f.specs(batch), {kBlockSize, true, Device::cuda(), 0}));
    Tensor out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());
    Tensor lse = Tensor::zeros({kHeads, t}, DType::F32, Device::cuda());
    impl->forward({}, query.to(Device::cuda()), {}, {}, flash.unbind_kv_cache(f.cache_gpu), *md, out, lse);
    expect_close(to_float_vector(out), want_out, "output");
    expect_close(to_float_vector(lse), want_lse, "lse");
  }
}

// The fp8 kernels compute in f16: bf16 queries past the f16 maximum must be
// scaled down on the way in (and the scale put back into the scores), or they
// would turn into inf. Queries ~2^20 with the softmax scale 2^-20 keep the
// scores ordinary.
TEST_F(CudaFlashTest, Fp8CacheWithQueriesPastTheF16RangeMatchesReference) {
  constexpr float kQueryGain = 1048576.0f;  // 2^20
  std::mt19937 rng(5);
  const Fixture f(rng, DType::FP8_E4M3);
  const AttentionBackend& flash = backend(kCudaFlashBackendName);
  const Batch batch{{1, 700}, {1, 90}, {40, 200}};  // decode items and a prefill item
  const int t = num_tokens(batch);
  std::vector<float> q = random_floats(static_cast<std::size_t>(t) * kHeads * kHeadSize, rng);
  for (float& x : q) x *= kQueryGain;
  const Tensor query = Tensor::from_floats(q, {t, kHeads, kHeadSize}, DType::BF16);
  AttentionImplParams cpu = impl_params(Device::cpu(), CacheDType::Fp8E4M3);
  AttentionImplParams gpu = impl_params(Device::cuda(), CacheDType::Fp8E4M3);
  cpu.scale /= kQueryGain;
  gpu.scale /= kQueryGain;
  const std::vector<float> k_scale{0.5f};
  const std::vector<float> v_scale{2.0f};
  LayerQuantState cpu_layer;
  cpu_layer.k_scale = Tensor::from_floats(k_scale, {1}, DType::F32);
  cpu_layer.v_scale = Tensor::from_floats(v_scale, {1}, DType::F32);
  LayerQuantState gpu_layer;
  gpu_layer.k_scale = Tensor::from_floats(k_scale, {1}, DType::F32, Device::cuda());
  gpu_layer.v_scale = Tensor::from_floats(v_scale, {1}, DType::F32, Device::cuda());
  for (LayerQuantState* layer : {&cpu_layer, &gpu_layer}) {
    layer->k_scale_float = k_scale[0];
    layer->v_scale_float = v_scale[0];
  }
  const auto [want_out, want_lse] = reference_run(f, batch, query, cpu, cpu_layer);
  auto impl = flash.make_impl(gpu);
  auto builder = flash.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cuda(), {}, kHeads});
  const auto md = builder->build(make_common_metadata(f.specs(batch), {kBlockSize, true, Device::cuda(), 0}));
  Tensor out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  Tensor lse = Tensor::zeros({kHeads, t}, DType::F32, Device::cuda());
  impl->forward(gpu_layer, query.to(Device::cuda()), {}, {}, flash.unbind_kv_cache(f.cache_gpu), *md, out, lse);
  expect_close(to_float_vector(out), want_out, "output");
  expect_close(to_float_vector(lse), want_lse, "lse");
}

// How a replayed graph's output is checked.
enum class ReplayCheck {
  EagerBitForBit,  // equal to an eager forward of the replayed batch
  Reference,       // close to REFERENCE (the captured kernel differs from the eager one)
};

// Captures one forward on a stream, then replays it after building the plan
// of another batch with the same token count.
void check_graph_replay(const Fixture& f, const Batch& captured, const Batch& replayed, std::mt19937& rng,
                        ReplayCheck check = ReplayCheck::EagerBitForBit) {
  ASSERT_EQ(num_tokens(captured), num_tokens(replayed));
  const AttentionBackend& flash = backend(kCudaFlashBackendName);
  const int t = num_tokens(captured);
  const Tensor query_cpu = Tensor::from_floats(random_floats(static_cast<std::size_t>(t) * kHeads * kHeadSize, rng),
                                               {t, kHeads, kHeadSize}, DType::BF16);
  const Tensor query = query_cpu.to(Device::cuda());
  const KVCacheView cache = flash.unbind_kv_cache(f.cache_gpu);
  auto impl = flash.make_impl(impl_params(Device::cuda()));
  auto builder = flash.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cuda(), {}, kHeads});
  const auto common_a = make_common_metadata(f.specs(captured), {kBlockSize, true, Device::cuda(), 0});
  const auto common_b = make_common_metadata(f.specs(replayed), {kBlockSize, true, Device::cuda(), 0});
  Tensor eager = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  Tensor graph_out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ForwardContext context;
  context.stream = stream;
  {
    ForwardContextScope scope(std::move(context));
    // Plan the larger batch first so the persistent workspace fits both.
    const auto md_b = builder->build(common_b);
    impl->forward({}, query, {}, {}, cache, *md_b, eager, {});
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<std::uint8_t> eager_b = to_byte_vector(eager);

    const auto md_a = builder->build(common_a);
    impl->forward({}, query, {}, {}, cache, *md_a, eager, {});
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<std::uint8_t> eager_a = to_byte_vector(eager);

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    impl->forward({}, query, {}, {}, cache, *md_a, graph_out, {});
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(to_byte_vector(graph_out), eager_a);

    const auto md_b2 = builder->build(common_b);  // new metadata, uploaded on the stream
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (check == ReplayCheck::EagerBitForBit) {
      EXPECT_EQ(to_byte_vector(graph_out), eager_b);
    } else {
      expect_close(to_float_vector(graph_out), reference_run(f, replayed, query_cpu, impl_params(Device::cpu())).first,
                   "replayed output");
    }

    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST_F(CudaFlashTest, GraphCapturedDecodeStepReplaysWithNewMetadata) {
  std::mt19937 rng(9);
  const Fixture f(rng);
  check_graph_replay(f, {{1, 300}, {1, 1000}, {1, 57}, {1, 2000}}, {{1, 1500}, {1, 20}, {1, 3000}, {1, 800}}, rng);
}

// A graph captured on an all-decode step holds the decode-only kernel; replayed
// with a plan that has a prefill item, it runs that item as 16-row decode
// passes, which must still be right.
TEST_F(CudaFlashTest, GraphCapturedDecodeStepReplaysAPrefillPlanCorrectly) {
  std::mt19937 rng(11);
  const Fixture f(rng);
  check_graph_replay(f, {{1, 300}, {1, 1000}, {1, 57}, {1, 2000}, {1, 64}, {1, 900}}, {{5, 600}, {1, 90}}, rng,
                     ReplayCheck::Reference);
}

// A graph captured on a prefill-only step holds, on sm_90, the wgmma kernel;
// replayed with a mixed plan it runs the decode items as 128-row passes.
TEST_F(CudaFlashTest, GraphCapturedPrefillStepReplaysAMixedPlanCorrectly) {
  std::mt19937 rng(12);
  const Fixture f(rng);
  check_graph_replay(f, {{40, 100}, {40, 200}}, {{70, 300}, {1, 700}, {4, 50}, {1, 90}, {4, 4}}, rng,
                     ReplayCheck::Reference);
}

TEST_F(CudaFlashTest, GraphCapturedMixedStepReplaysWithNewMetadata) {
  std::mt19937 rng(10);
  const Fixture f(rng);
  check_graph_replay(f, {{40, 100}, {1, 700}, {1, 33}}, {{40, 40}, {1, 2500}, {1, 90}}, rng);
}

}  // namespace
}  // namespace pagedattn
