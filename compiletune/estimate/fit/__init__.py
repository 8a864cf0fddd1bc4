"""Whether a step fits, and what to do when it does not, one room per question:

capacity.py   what a run must fit in (a GPU's memory less a reserve, one machine's host
              memory), whether an estimate fits it, --device-memory's names
ladder.py     the ladder of techniques (cheapest first), its rows for --ladder, the longest
              --seq-len that fits (--max-seq-len), and the bounds on a search's estimates
advice.py     the cheapest flags that make a step fit (smaller micro-batches, more GPUs)
preflight.py  train's check before a run on a GPU: refuse a step that will not fit, with advice
printing.py   the estimate, the ladders and --max-seq-len's answer as printed
"""
