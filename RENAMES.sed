# Renames of issue 30 item 6 (branch wt/names). Apply with: sed -i -f RENAMES.sed FILES (GNU sed, word-bounded).
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
# executor/batch_runner.py's own split_rows (one request into parts under the row cap) is split_request: rename it first.
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
