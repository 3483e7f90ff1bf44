# Renames of issue 30 item 6 (branch wt/names). Apply with: sed -i -f RENAMES.sed FILES (GNU sed, word-bounded),
# then `ruff check --fix` (merges the split executor.messages imports) and `ruff format`. By hand afterwards:
# - the call sites of the two `resolve`s in files that import them by name: `resolve(` -> `resolve_plan(` (from
#   config.deployment) / `resolve_model(` (from models.registry); `registry.resolve(` is covered below;
# - `\bOverlap\b` also hits the English word at the start of a comment ("Overlap (dynamic / continuous)" in
#   engine/batch_loop.py): keep those;
# - flat flag reads on ServerArgs (`args.port`): the aliases are gone; read the section (`args.http.port`).
# Modules
s|\bdiffuserve\.pipelines\.overlap\b|diffuserve.pipelines.lanes|g
s|\bpipelines/overlap\.py\b|pipelines/lanes.py|g
s|\bdiffuserve\.engine\.faults\b|diffuserve.pipelines.fault_hooks|g
s|\bengine/faults\.py\b|pipelines/fault_hooks.py|g
s|\btest_overlap\.py\b|test_lanes.py|g
# Classes and functions
s|\bOverlap\b|Lanes|g
s|\b_side_lanes\b|_lanes|g
s|\bside_lanes\b|lanes|g
s|\bComponentUser\b|Residency|g
s|\bDynamicBatcher\b|RequestLevelScheduler|g
# executor/batch_runner.py's own split_rows (one request into parts under the row cap) is split_request: rename it
# first in batch_runner.py and its importers (tests/unit/test_cli_first_hour.py), then apply this to the rest.
s|\bsplit_rows\b|rows_per_request|g
s|\bfrom diffuserve\.executor\.batch_runner import PreviewSink\b|from diffuserve.executor.messages import PreviewSink|g
s|\bregistry import resolve as resolve_model\b|registry import resolve_model|g
s|\bregistry import resolve\b|registry import resolve_model|g
s|\bregistry\.resolve(|registry.resolve_model(|g
s|\(from diffuserve\.config\.deployment import .*\)\bresolve\b|\1resolve_plan|g
s|\bdeployment\.resolve\b|deployment.resolve_plan|g
# Flags: the step-cache flags are their own section (read args.step_cache.method / .options / .calibration)
s|\bargs\.step_cache_calibration\b|args.step_cache.calibration|g
s|\bargs\.step_cache_config\b|args.step_cache.options|g
s|\boverlap_for\b|lanes_for|g
s|\bfrom diffuserve\.executor\.batch_runner import BatchOutcome, PreviewSink$|from diffuserve.executor.batch_runner import BatchOutcome\nfrom diffuserve.executor.messages import PreviewSink|
s|\bfrom diffuserve\.executor\.batch_runner import NoEvents, PreviewSink$|from diffuserve.executor.batch_runner import NoEvents\nfrom diffuserve.executor.messages import PreviewSink|
s|\bFetchPolicy\.from_args(ctx\.args)|FetchPolicy.from_limits(ctx.args.limits)|g
# Sectioned flag reads: ctx.args is always ServerArgs (other `args` may be argparse namespaces or sub-configs: check
# those by hand, e.g. grep -rnE '\bargs\.(port|max_loras|model_path)\b')
s|\bctx\.args\.model_path\b|ctx.args.model.model_path|g
s|\bctx\.args\.model_id\b|ctx.args.model.model_id|g
s|\bctx\.args\.transformer_path\b|ctx.args.model.transformer_path|g
s|\bctx\.args\.served_model_name\b|ctx.args.model.served_model_name|g
s|\bctx\.args\.backend\b|ctx.args.model.backend|g
s|\bctx\.args\.device\b|ctx.args.model.device|g
s|\bctx\.args\.dtype\b|ctx.args.model.dtype|g
s|\bctx\.args\.num_threads\b|ctx.args.model.num_threads|g
s|\bctx\.args\.mesh_texture\b|ctx.args.model.mesh_texture|g
s|\bctx\.args\.host\b|ctx.args.http.host|g
s|\bctx\.args\.port\b|ctx.args.http.port|g
s|\bctx\.args\.log_level\b|ctx.args.http.log_level|g
s|\bctx\.args\.shutdown_timeout_s\b|ctx.args.http.shutdown_timeout_s|g
s|\bctx\.args\.max_inference_steps\b|ctx.args.http.max_inference_steps|g
s|\bctx\.args\.max_image_side\b|ctx.args.http.max_image_side|g
s|\bctx\.args\.max_octree_resolution\b|ctx.args.http.max_octree_resolution|g
s|\bctx\.args\.url_store_max_images\b|ctx.args.http.url_store_max_images|g
s|\bctx\.args\.max_video_jobs\b|ctx.args.http.max_video_jobs|g
s|\bctx\.args\.max_mesh_jobs\b|ctx.args.http.max_mesh_jobs|g
s|\bctx\.args\.output_dir\b|ctx.args.http.output_dir|g
s|\bctx\.args\.result_ttl_s\b|ctx.args.http.result_ttl_s|g
s|\bctx\.args\.result_cache_mib\b|ctx.args.http.result_cache_mib|g
s|\bctx\.args\.max_output_bytes\b|ctx.args.http.max_output_bytes|g
s|\bctx\.args\.result_sweep_interval_s\b|ctx.args.http.result_sweep_interval_s|g
s|\bctx\.args\.max_video_frames\b|ctx.args.http.max_video_frames|g
s|\bctx\.args\.api_process\b|ctx.args.http.api_process|g
s|\bctx\.args\.batching_mode\b|ctx.args.batching.mode|g
s|\bctx\.args\.batching_max_size\b|ctx.args.batching.max_size|g
s|\bctx\.args\.batching_max_tokens\b|ctx.args.batching.max_tokens|g
s|\bctx\.args\.batching_order\b|ctx.args.batching.order|g
s|\bctx\.args\.batching_delay_ms\b|ctx.args.batching.delay_ms|g
s|\bctx\.args\.batching_config\b|ctx.args.batching.rules_path|g
s|\bctx\.args\.enable_batching_metrics\b|ctx.args.batching.enable_metrics|g
s|\bctx\.args\.max_queue_size\b|ctx.args.engine.max_queue_size|g
s|\bctx\.args\.request_timeout_s\b|ctx.args.engine.request_timeout_s|g
s|\bctx\.args\.activation_memory_gib\b|ctx.args.engine.activation_memory_gib|g
s|\bctx\.args\.enable_warmup\b|ctx.args.engine.enable_warmup|g
s|\bctx\.args\.warmup_steps\b|ctx.args.engine.warmup_steps|g
s|\bctx\.args\.step_cache_config\b|ctx.args.engine.step_cache_config|g
s|\bctx\.args\.step_cache_calibration\b|ctx.args.engine.step_cache_calibration|g
s|\bctx\.args\.max_request_bytes\b|ctx.args.limits.max_request_bytes|g
s|\bctx\.args\.max_upload_bytes\b|ctx.args.limits.max_upload_bytes|g
s|\bctx\.args\.max_prompt_chars\b|ctx.args.limits.max_prompt_chars|g
s|\bctx\.args\.api_key\b|ctx.args.limits.api_key|g
s|\bctx\.args\.reject_truncated_prompts\b|ctx.args.limits.reject_truncated_prompts|g
s|\bctx\.args\.allow_remote_urls\b|ctx.args.limits.allow_remote_urls|g
s|\bctx\.args\.allowed_media_domains\b|ctx.args.limits.allowed_media_domains|g
s|\bctx\.args\.media_fetch_timeout_s\b|ctx.args.limits.media_fetch_timeout_s|g
s|\bctx\.args\.nnodes\b|ctx.args.dist.nnodes|g
s|\bctx\.args\.node_rank\b|ctx.args.dist.node_rank|g
s|\bctx\.args\.dist_init_addr\b|ctx.args.dist.dist_init_addr|g
s|\bctx\.args\.dist_heartbeat_timeout_s\b|ctx.args.dist.dist_heartbeat_timeout_s|g
s|\bctx\.args\.dist_timeout_s\b|ctx.args.dist.dist_timeout_s|g
s|\bctx\.args\.results_db\b|ctx.args.store.results_db|g
s|\bctx\.args\.media_store\b|ctx.args.store.media_store|g
s|\bctx\.args\.s3_endpoint_url\b|ctx.args.store.s3_endpoint_url|g
s|\bctx\.args\.media_store_create_bucket\b|ctx.args.store.media_store_create_bucket|g
s|\bctx\.args\.media_presign_s\b|ctx.args.store.media_presign_s|g
s|\bctx\.args\.owner_timeout_s\b|ctx.args.store.owner_timeout_s|g
s|\bctx\.args\.lora_modules\b|ctx.args.lora.lora_modules|g
s|\bctx\.args\.max_loras\b|ctx.args.lora.max_loras|g
s|\bctx\.args\.max_lora_rank\b|ctx.args.lora.max_lora_rank|g
s|\bctx\.args\.max_cpu_loras\b|ctx.args.lora.max_cpu_loras|g
s|\bctx\.args\.enable_lora_updates\b|ctx.args.lora.enable_lora_updates|g
s|\bctx\.args\.lora_root\b|ctx.args.lora.lora_root|g
s|\bctx\.args\.controlnet\b|ctx.args.control.controlnet|g
s|\bctx\.args\.control_image\b|ctx.args.control.control_image|g
s|\bctx\.args\.control_mode\b|ctx.args.control.control_mode|g
s|\bctx\.args\.controlnet_conditioning_scale\b|ctx.args.control.controlnet_conditioning_scale|g
s|\bctx\.args\.control_guidance_start\b|ctx.args.control.control_guidance_start|g
s|\bctx\.args\.control_guidance_end\b|ctx.args.control.control_guidance_end|g
s|\bctx\.args\.controlnet_name\b|ctx.args.control.controlnet_name|g
s|\bctx\.args\.quantization\b|ctx.args.quant.quantization|g
s|\bctx\.args\.quantization_ignored_layers\b|ctx.args.quant.quantization_ignored_layers|g
