# The demo drafters' training mix, shared by run.sh and run2.sh: stage 2 extends stage 1's feature
# folder, which `spechead extract` only accepts for the same data (same records, same chunk order).
D=../shared/data/train
DATA="$D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:1500 $D/chat_gpteacher.jsonl.gz:500
      $D/math_gsm8k_train.jsonl.gz:800 $D/mt_de_en.jsonl.gz:800 $D/summ_t0_news.jsonl.gz:400
      $D/qa_nq_open.jsonl.gz:600 $D/qa_t0_context.jsonl.gz:400 $D/code_instruct.jsonl.gz:400"
