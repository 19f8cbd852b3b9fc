// CUDA_FLASH on a GPU: mixed and split-KV batches against REFERENCE, fp8 K/V
// with queries past the f16 range, cascade plans against the plain plan, and
// CUDA graph capture of a decode step and a mixed step replayed with new
// metadata (a decode step also with a prefill plan and with a cascade plan).
// Skipped without a CUDA device; the full feature grid is the conformance
// suite (`pagedattn conformance --backend CUDA_FLASH`).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <pagedattn/cascade.h>
#include <pagedattn/conformance.h>
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
#include "testing/expect_error.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 128;
constexpr int kBlockSize = 16;
constexpr int kNumBlocks = 700;
constexpr float kAtol = 1e-2f;
constexpr float kRtol = 1e-2f;
// Cascade steps share their requests' first kSharedBlocks blocks: 272 keys,
// past kCascadeMinPrefixTokens and off the 64-key tile grid.
constexpr int kSharedBlocks = 17;

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

  // Every request's first `shared_blocks` blocks are the same (a shared
  // prefix), the others its own.
  std::vector<RequestSpec> specs(const Batch& batch, int shared_blocks = 0) const {
    std::vector<RequestSpec> out;
    auto next = static_cast<std::size_t>(shared_blocks);
    for (const auto& [q, s] : batch) {
      RequestSpec r{q, s, {}};
      const int blocks = (s + kBlockSize - 1) / kBlockSize;
      for (int b = 0; b < blocks; ++b) {
        r.blocks.push_back(b < shared_blocks ? free_blocks.at(static_cast<std::size_t>(b))
                                             : free_blocks.at(next++ % free_blocks.size()));
      }
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
                                                                const LayerQuantState& layer = {},
                                                                int shared_blocks = 0) {
  const AttentionBackend& ref = backend("REFERENCE");
  auto impl = ref.make_impl(params);
  auto builder = ref.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cpu(), {}});
  const auto specs = f.specs(batch, shared_blocks);
  const auto md = builder->build(make_common_metadata(specs, {kBlockSize, true, Device::cpu(), 0}));
  const int t = num_tokens(batch);
  Tensor out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16);
  Tensor lse = Tensor::zeros({kHeads, t}, DType::F32);
  impl->forward(layer, query, {}, {}, ref.unbind_kv_cache(f.cache_cpu), *md, out, lse);
  return {to_float_vector(out), to_float_vector(lse)};
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, std::string_view what,
                  Tolerance tol = {kAtol, kRtol}) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = (std::isinf(want[i]) && got[i] == want[i]) ||
                    std::fabs(got[i] - want[i]) <= tol.atol + tol.rtol * std::fabs(want[i]);
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

// One layer's forward planned by a CascadeBuilder (`allow`, `mode`) over
// `batch`, whose requests share their first kSharedBlocks blocks.
struct PlannedRun {
  std::vector<float> out;
  std::vector<float> lse;
  bool cascade = false;
};
PlannedRun run_planned(const Fixture& f, const Batch& batch, const Tensor& query, bool allow, CascadeMode mode) {
  const AttentionBackend& flash = backend(kCudaFlashBackendName);
  auto impl = flash.make_impl(impl_params(Device::cuda()));
  CascadeBuilder builder(flash, {kBlockSize, kKvHeads, kHeadSize, Device::cuda(), {}, kHeads}, DType::BF16, allow,
                         mode);
  const auto md =
      builder.build(make_common_metadata(f.specs(batch, kSharedBlocks), {kBlockSize, true, Device::cuda(), 0}));
  const int t = num_tokens(batch);
  const Tensor q = query.to(Device::cuda());
  const KVCacheView cache = flash.unbind_kv_cache(f.cache_gpu);
  Tensor out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  Tensor lse = Tensor::zeros({kHeads, t}, DType::F32, Device::cuda());
  check_planned_forward(*impl, {}, q, {}, {}, cache, *md, out, lse);
  planned_forward(*impl, {}, q, {}, {}, cache, *md, out, lse);
  return {to_float_vector(out), to_float_vector(lse), builder.last_used_cascade()};
}

// The same step planned plain, as CUDA_FLASH's cascade plan (one attention
// launch over both passes' items, one combine) and as the generic cascade
// (two plans and merge_attn_states): the same results within the bf16 row of
// the tolerance table, and the cascade plan within it of REFERENCE. A mixed
// step (speculative steps, prefill chunks: the mixed kernel) and a decode
// step (the decode-only kernel).
TEST_F(CudaFlashTest, CascadePlansMatchThePlainPlan) {
  std::mt19937 rng(13);
  const Fixture f(rng);
  const Tolerance out_tol = tolerance(CheckedQuantity::Output, DType::BF16);
  const Tolerance lse_tol = tolerance(CheckedQuantity::Lse, DType::BF16);
  Batch decodes;
  for (int r = 0; r < kCascadeMinRequests + 4; ++r) decodes.emplace_back(1, 600 + 211 * r);
  for (const Batch& batch : {Batch{{1, 900}, {1, 1500}, {3, 700}, {1, 300}, {9, 1000}, {1, 2500}, {70, 800},
                                   {1, 400}, {4, 1200}, {1, 290}, {1, 3000}, {33, 600}},
                             decodes}) {
    const int t = num_tokens(batch);
    const Tensor query = Tensor::from_floats(random_floats(static_cast<std::size_t>(t) * kHeads * kHeadSize, rng),
                                             {t, kHeads, kHeadSize}, DType::BF16);
    const PlannedRun plain = run_planned(f, batch, query, false, CascadeMode::Native);
    const PlannedRun native = run_planned(f, batch, query, true, CascadeMode::Native);
    const PlannedRun generic = run_planned(f, batch, query, true, CascadeMode::Generic);
    EXPECT_FALSE(plain.cascade);
    ASSERT_TRUE(native.cascade);
    ASSERT_TRUE(generic.cascade);
    expect_close(native.out, plain.out, "cascade plan output", out_tol);
    expect_close(native.lse, plain.lse, "cascade plan lse", lse_tol);
    expect_close(generic.out, plain.out, "generic cascade output", out_tol);
    expect_close(generic.lse, plain.lse, "generic cascade lse", lse_tol);
    const auto [want_out, want_lse] = reference_run(f, batch, query, impl_params(Device::cpu()), {}, kSharedBlocks);
    expect_close(native.out, want_out, "cascade plan output against REFERENCE", out_tol);
    expect_close(native.lse, want_lse, "cascade plan lse against REFERENCE", lse_tol);
  }
}

// A cascade plan handed to a layer it cannot be right for is refused.
TEST_F(CudaFlashTest, ACascadePlanIsRefusedByALayerWithAWindow) {
  std::mt19937 rng(15);
  const Fixture f(rng);
  const AttentionBackend& flash = backend(kCudaFlashBackendName);
  AttentionImplParams params = impl_params(Device::cuda());
  params.sliding_window = kBlockSize;
  auto impl = flash.make_impl(params);
  auto builder = flash.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cuda(), {}, kHeads});
  const Batch batch{{1, 400}, {1, 500}};
  const auto md = builder->build_cascade(
      make_common_metadata(f.specs(batch, kSharedBlocks), {kBlockSize, true, Device::cuda(), 0}), kSharedBlocks);
  ASSERT_NE(md, nullptr);
  const Tensor query = Tensor::zeros({2, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  Tensor out = Tensor::zeros({2, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  test::expect_invalid(
      [&] { impl->check_forward({}, query, {}, {}, flash.unbind_kv_cache(f.cache_gpu), *md, out, {}); },
      "a cascade plan");
}

// How a replayed graph's output is checked.
enum class ReplayCheck {
  EagerBitForBit,  // equal to an eager forward of the replayed batch
  Reference,       // close to REFERENCE (the captured kernel differs from the eager one)
};

// Captures one forward on a stream, then replays it after building the plan
// of another batch with the same token count: a cascade over its first
// `replayed_shared_blocks` blocks, shared by every request, when > 0.
void check_graph_replay(const Fixture& f, const Batch& captured, const Batch& replayed, std::mt19937& rng,
                        ReplayCheck check = ReplayCheck::EagerBitForBit, int replayed_shared_blocks = 0) {
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
  const auto common_b =
      make_common_metadata(f.specs(replayed, replayed_shared_blocks), {kBlockSize, true, Device::cuda(), 0});
  const auto plan_b = [&] {
    return replayed_shared_blocks > 0 ? builder->build_cascade(common_b, replayed_shared_blocks)
                                      : builder->build(common_b);
  };
  Tensor eager = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());
  Tensor graph_out = Tensor::zeros({t, kHeads, kHeadSize}, DType::BF16, Device::cuda());

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ForwardContext context;
  context.stream = stream;
  {
    ForwardContextScope scope(std::move(context));
    // Plan the larger batch first so the persistent workspace fits both.
    const auto md_b = plan_b();
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

    const auto md_b2 = plan_b();  // new metadata, uploaded on the stream
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (check == ReplayCheck::EagerBitForBit) {
      EXPECT_EQ(to_byte_vector(graph_out), eager_b);
    } else {
      expect_close(to_float_vector(graph_out),
                   reference_run(f, replayed, query_cpu, impl_params(Device::cpu()), {}, replayed_shared_blocks).first,
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

// A cascade plan is an ordinary plan of the same builder: a graph captured on
// a plain decode step replays it, bit for bit as an eager forward.
TEST_F(CudaFlashTest, GraphCapturedDecodeStepReplaysACascadePlan) {
  std::mt19937 rng(14);
  const Fixture f(rng);
  check_graph_replay(f, {{1, 300}, {1, 1000}, {1, 57}, {1, 2000}}, {{1, 1500}, {1, 400}, {1, 3000}, {1, 800}}, rng,
                     ReplayCheck::EagerBitForBit, kSharedBlocks);
}

TEST_F(CudaFlashTest, GraphCapturedMixedStepReplaysWithNewMetadata) {
  std::mt19937 rng(10);
  const Fixture f(rng);
  check_graph_replay(f, {{40, 100}, {1, 700}, {1, 33}}, {{40, 40}, {1, 2500}, {1, 90}}, rng);
}

}  // namespace
}  // namespace pagedattn
