"""jfk through stock whisper.cpp (pywhispercpp, as tests/test_grid_whisper_cpp.py does): WER and the text of each
file. Usage (from the repository root): python results/lookup-pass/jfk.py FILE.bin ..."""
import sys, jiwer
sys.path.insert(0, "tests")
from tarq_deploy.data.real_clips import JFK_TEXT, all_real_clips
from test_whisper_cpp_export import transcribe_whisper_cpp, words
jfk = next(c for c in all_real_clips() if "jfk" in str(c.path)).path
for path in sys.argv[1:]:
    from pathlib import Path
    text = transcribe_whisper_cpp(Path(path), str(jfk))
    print(path, round(jiwer.wer(words(JFK_TEXT), words(text)), 3), repr(text[:120]))
