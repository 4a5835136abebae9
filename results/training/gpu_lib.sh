# The end of a GPU stage's device call (stages 10 and 11), sourced by its gpu.sh with W (work folder) and OUT set:
# what comes back through the call's $OUT, which takes files of limited size. The three runs' logs, the drafters,
# their metrics and the generation manifest in one tar, split into 15 MiB parts, and the new replies, gzipped, when
# they fit.
#   send_back STAGE REPLIES.jsonl     (e.g. send_back stage11 $W/greedy11.jsonl)
send_back() {
  local stage=$1 replies=$2
  for r in e2 e3 lr72; do echo "== $r"; tail -c 600 $W/$r.log; done
  cp $replies.manifest.json $W/gen_data_manifest.json 2>/dev/null
  (cd $W && tar cf $W/$stage.tar gen_data_manifest.json *run/metrics.json *run/train_log.jsonl \
    *run/model.safetensors *run/config.json *.log 2>/dev/null; ls -la $W/$stage.tar)
  split -b 15m -d $W/$stage.tar $OUT/$stage.tar.
  gzip -6 -c $replies > $replies.gz && ls -la $replies.gz
  [ $(stat -c %s $replies.gz) -le 14000000 ] && cp $replies.gz $OUT/
}
