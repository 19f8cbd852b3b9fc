#include <pagedattn/dtype.h>
#include <pagedattn/selector.h>

#include "commands.h"

namespace pagedattn::cli {
namespace {

struct SelectOptions {
  int head_size = 0;
  std::string dtype = "bf16";
  std::string kv_cache_dtype = "auto";
  std::optional<int> block_size;
  bool sinks = false;
  bool mla = false;
  bool non_causal = false;
  bool batch_invariant = false;
  std::string attn_type = "decoder";
  std::string backend;
  std::string device;
};

// The first CUDA device when one is present, else the CPU.
Device default_device() {
  for (const Device& d : available_devices()) {
    if (d.is_cuda()) return d;
  }
  return Device::cpu();
}

int run_select(const SelectOptions& o) {
  SelectorConfig cfg;
  cfg.head_size = o.head_size;
  const auto dtype = parse_dtype(o.dtype);
  if (!dtype) throw_invalid("select", "--dtype", "f32, f16 or bf16", o.dtype);
  cfg.dtype = *dtype;
  const auto kv = parse_cache_dtype(o.kv_cache_dtype);
  if (!kv) {
    throw_invalid("select", "--kv-cache-dtype", "a vLLM cache dtype (pagedattn info lists them)",
                  o.kv_cache_dtype);
  }
  cfg.kv_cache_dtype = *kv;
  cfg.block_size = o.block_size;
  cfg.has_sink = o.sinks;
  cfg.use_mla = o.mla;
  cfg.use_non_causal = o.non_causal;
  cfg.use_batch_invariant = o.batch_invariant;
  const auto type = parse_attention_type(o.attn_type);
  if (!type) throw_invalid("select", "--attn-type", "decoder, encoder, encoder_only or encoder_decoder", o.attn_type);
  cfg.attn_type = *type;
  if (o.device.empty()) {
    cfg.device = default_device();
  } else {
    const auto device = parse_device(o.device);
    if (!device) throw_invalid("select", "--device", "cpu or cuda[:N]", o.device);
    cfg.device = *device;
  }
  cfg.capability = device_capability(cfg.device);

  const SelectionReport report = explain_selection(cfg, o.backend);
  fmt::print("config: {}\n", cfg.str());
  for (const BackendVerdict& v : report.verdicts) {
    const bool chosen = report.chosen != nullptr && report.chosen->name() == v.name;
    if (chosen) {
      fmt::print("  {:<12} selected\n", v.name);
    } else if (v.reasons.empty()) {
      fmt::print("  {:<12} valid (lower priority)\n", v.name);
    } else {
      std::string reasons;
      for (const std::string& r : v.reasons) reasons += (reasons.empty() ? "" : "; ") + r;
      fmt::print("  {:<12} rejected: {}\n", v.name, reasons);
    }
  }
  if (report.chosen == nullptr) {
    fmt::print("no valid attention backend for this configuration\n");
    return kExitFailed;
  }
  fmt::print("selected: {}{}\n", report.chosen->name(), report.explicit_request ? " (requested)" : "");
  return kExitOk;
}

}  // namespace

void add_select_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("select", "Explain which backend serves a configuration and why others don't");
  auto o = std::make_shared<SelectOptions>();
  cmd->add_option("--head-size", o->head_size, "Head size")->required()->check(in_range(1, kMaxHeadSize));
  cmd->add_option("--dtype", o->dtype, "Model dtype (f32, f16, bf16)")->capture_default_str();
  cmd->add_option(
         "--kv-cache-dtype", o->kv_cache_dtype,
         "KV cache dtype (auto, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head, fp8_per_token_head, ...)")
      ->capture_default_str();
  cmd->add_option("--block-size", o->block_size, "KV cache block size (filtered only when given)")
      ->check(in_range(1, kMaxBlockSize));
  cmd->add_flag("--sinks", o->sinks, "The model uses attention sinks");
  cmd->add_flag("--mla", o->mla, "Multi-head latent attention");
  cmd->add_flag("--non-causal", o->non_causal, "Non-causal decoder attention");
  cmd->add_flag("--batch-invariant", o->batch_invariant, "Require batch-invariant results");
  cmd->add_option("--attn-type", o->attn_type, "decoder, encoder, encoder_only or encoder_decoder")
      ->capture_default_str();
  cmd->add_option("--backend", o->backend, "Request a backend by name (validated, never replaced)");
  cmd->add_option("--device", o->device, "cpu or cuda[:N] (default: a CUDA device if present, else cpu)");
  cmd->callback([o, &exit_code] { exit_code = run_select(*o); });
}

}  // namespace pagedattn::cli
