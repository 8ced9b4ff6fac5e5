#!/usr/bin/env python3
"""Writes tests/data/tokenizer/corpus.jsonl: the tokenizer test corpus.

Deterministic, standard library only (runs anywhere: `python3 make_corpus.py`).
One JSON object per line: {"text": "..."}. The lines are hand-picked edge cases for a
byte-level BPE tokenizer configured like Qwen3's tokenizer.json (NFC normalizer, the Qwen
Split regex, ByteLevel, added special tokens split out before normalization). The golden ids
for every line are made by ../hf/make_fixtures.py with HF tokenizers on the GPU machine.
"""
import json
import os
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))


def lines():
    out = []
    add = out.append

    # --- empty and whitespace only -------------------------------------------------------
    for t in ["", " ", "  ", "   ", "    ", " " * 17, "\t", "\t\t", "\n", "\n\n", "\n\n\n",
              "\r\n", "\r\n\r\n", "\r", " \n", "\n ", " \n ", "\t \n \t", "  \n\n  \n",
              "\u00a0", "\u3000", "\u2003\u2002", " \u00a0 ", "\v\f"]:
        add(t)

    # --- plain English, trailing / leading spaces, whitespace runs ------------------------
    for t in ["Hello world", "Hello world ", "Hello world   ", "  Hello world", "Hello  world",
              "Hello   \t  world", "Hello\tworld", "Hello\nworld", "Hello\n\nworld\n",
              "Hello \n world", "Hello   \n\n   world   ", "end with newline\n",
              "end with spaces and newline   \n", "a", "A", "I", "ab cd ef", "x  y   z    w",
              "The quick brown fox jumps over the lazy dog.",
              "In the beginning God created the heaven and the earth.",
              "And God said, Let there be light: and there was light."]:
        add(t)

    # --- contractions in every case --------------------------------------------------------
    for t in ["it's", "IT'S", "It'S", "don't", "DON'T", "we're", "WE'RE", "We'Re", "they've",
              "THEY'VE", "they'Ve", "I'm", "I'M", "we'll", "WE'LL", "We'Ll", "he'd", "HE'D",
              "he'D", "'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'Ve", "'VE", "'m", "'M",
              "'ll", "'LL", "'lL", "'d", "'D", "''s", "'x", "'sa", "it's'S'T 're'Ve'LL'd",
              "rock 'n' roll", "the dogs' bones", "'quoted'", "O'Neil's", "y'all'd've",
              "can\u2019t (curly apostrophe)"]:
        add(t)

    # --- digits: one at a time under \\p{N} -------------------------------------------------
    for n in [1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 25]:
        add("".join(str((i * 7 + 3) % 10) for i in range(n)))
    for t in ["3.14159", "1,000,000", "-42", "+7", "1e10", "0x1F", "v1.2.3", "abc123def",
              "123abc", "abc 123 def", "a1b2c3d4", "2024-12-01T13:40:00Z", "CO2 H2O",
              "\u0661\u0662\u0663 arabic-indic", "\u0968\u0966\u0968\u096a devanagari",
              "\uff11\uff12\uff13 fullwidth", "\u00bd \u2153 \u2460\u2461 \u00b2\u00b3",
              "room 101, floor 7", "$19.99 or \u20ac5"]:
        add(t)

    # --- punctuation runs ------------------------------------------------------------------
    for t in ["!!!", "?!?!", "...", "\u2026", "---", "===", "!@#$%^&*()", "a!!b??c",
              "hello!!!\n\n", "(x)", "[[nested]]", "{\"json\": [1, 2]}", ";;\n;;\r\n",
              "-->", "<-", "a,b,c", " , . ; : ", "__init__", "#include <vector>", "//", "/* */",
              "\u00ab\u00bb \u201c\u201d \u300c\u300d"]:
        add(t)

    # --- multilingual ---------------------------------------------------------------------
    for t in ["\u4f60\u597d\uff0c\u4e16\u754c\uff01",
              "\u6211\u4eec\u6b63\u5728\u6d4b\u8bd5\u5206\u8bcd\u5668\u3002",
              "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
              "\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a",
              "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",
              "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
              "\u0627\u0644\u0633\u0644\u0627\u0645 \u0639\u0644\u064a\u0643\u0645 123",
              "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
              "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e",
              "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
              "\u0421\u044a\u0435\u0448\u044c \u0436\u0435 \u0435\u0449\u0451 \u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 \u0444\u0440\u0430\u043d\u0446\u0443\u0437\u0441\u043a\u0438\u0445 \u0431\u0443\u043b\u043e\u043a",
              "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
              "\u1f08\u03bd \u1f00\u03c1\u03c7\u1fc7 \u1f26\u03bd \u1f41 \u03bb\u03cc\u03b3\u03bf\u03c2",
              "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
              "\u05d1\u05bc\u05b0\u05e8\u05b5\u05d0\u05e9\u05c1\u05b4\u05d9\u05ea",
              "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
              "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e44\u0e21\u0e48\u0e21\u0e35\u0e0a\u0e48\u0e2d\u0e07\u0e27\u0e48\u0e32\u0e07",
              "mixed English \u4e2d\u6587 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
              "Stra\u00dfe \u00fcber \u00e4rger \u00f6l",
              "\u0130stanbul \u0131\u015f\u0131k",
              "Vi\u1ec7t Nam",
              "\u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8 \u0570\u0561\u0575\u0565\u0580\u0565\u0576",
              "\U00010348 gothic, \U0001d400 math bold, \U00020000 cjk ext-b"]:
        add(t)

    # --- emoji, ZWJ sequences, flags, skin tones -----------------------------------------
    for t in ["\U0001f600", "\U0001f600\U0001f601\U0001f602", "I love \U0001f355!",
              "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
              "\U0001f469\u200d\U0001f4bb coding", "\U0001f3f3\ufe0f\u200d\U0001f308",
              "\u2764\ufe0f", "\u2764", "\U0001f1fa\U0001f1f8", "\U0001f1ef\U0001f1f5\U0001f1e9\U0001f1ea\U0001f1eb\U0001f1f7",
              "\U0001f44d\U0001f3fb\U0001f44d\U0001f3fc\U0001f44d\U0001f3fd\U0001f44d\U0001f3fe\U0001f44d\U0001f3ff",
              "\U0001f469\U0001f3fd\u200d\U0001f692", "1\ufe0f\u20e3 #\ufe0f\u20e3",
              "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
              "emoji\U0001f600word", "  \U0001f600  ", "\u200b\u200c\u200d zero widths",
              "\ufeffBOM at start"]:
        add(t)

    # --- combining characters: NFC and NFD forms -------------------------------------------
    composed = ["caf\u00e9", "na\u00efve r\u00e9sum\u00e9", "\u00c5ngstr\u00f6m",
                "Fran\u00e7ais \u00e0 la cr\u00e8me br\u00fbl\u00e9e", "\u1ec7\u1ebf\u1ed9",
                "\ud55c\uae00", "\u304c\u304e\u3050", "\u00f1 \u00d1"]
    for t in composed:
        add(unicodedata.normalize("NFC", t))
        add(unicodedata.normalize("NFD", t))
    for t in ["e\u0301", "e\u0301\u0301", "a\u0308\u0304", "\u1100\u1161\u11a8",
              "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319a\u0310l\u0352g\u0303o",
              "\u212b (angstrom sign)", "\u2126 (ohm sign)", "\ufb01 ligature", "\u0301 leading combining"]:
        add(t)

    # --- code -----------------------------------------------------------------------------
    add("def f(x):\n\treturn x + 1\n")
    add("def g(y):\n    if y:\n\t    return y\n    return 0\n")
    add("int main() {\r\n  printf(\"hi\\n\");\r\n  return 0;\r\n}\r\n")
    add("for (int i = 0; i < n; ++i) {\n\t\tsum += a[i] * b[i];\n}")
    add("class A:\n    \"\"\"Doc.\"\"\"\n\n    def __init__(self):\n        self.x = {'a': 1}\n")
    add("if x == 1:\n  \t  pass   \n\n\n")
    add("SELECT id, name FROM users WHERE age >= 18 ORDER BY name;")
    add("const f = (a, b) => a ?? b;  // nullish\n")
    add("#!/bin/sh\nset -eu\necho \"$HOME\" | tr a-z A-Z\n")
    add("<div class=\"x\">&amp; &lt;tag&gt;</div>")
    add("    indented four\n\tindented tab\n  \t mixed\n")
    add("x=1;y=2;z=x+y")
    add("matrix[i][j] += 0.5*(a-b)**2")

    # --- URLs, e-mail, paths ----------------------------------------------------------------
    for t in ["https://example.com/path?q=1&r=two#frag", "http://localhost:8080/v1/chat",
              "see https://en.wikipedia.org/wiki/Byte_pair_encoding.",
              "user.name+tag@example.co.uk", "/usr/lib/x86_64-linux-gnu/libc.so.6",
              "C:\\Users\\Public\\file.txt"]:
        add(t)

    # --- long words -------------------------------------------------------------------------
    for t in ["antidisestablishmentarianism", "pneumonoultramicroscopicsilicovolcanoconiosis",
              "Donaudampfschifffahrtsgesellschaftskapit\u00e4n", "a" * 64, "ab" * 40,
              "x" * 300, "\u4e2d" * 50, "\U0001f600" * 20,
              "Supercalifragilisticexpialidocious" * 3]:
        add(t)

    # --- special tokens inside text -------------------------------------------------------
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
              "<|im_start|><|im_end|>", "<|endoftext|><|endoftext|>",
              " <|im_start|> ", "hello<|im_end|>world", "hello <|im_end|> world",
              "\n<|im_start|>\n", "<|im_start|>user\nhi<|im_end|>\n",
              "text<|endoftext|>", "<|endoftext|>text", "a <|endoftext|>b",
              "<think>\nreasoning here\n</think>\n\nanswer", "  <think>  </think>  ",
              "<|im_start|>assistant\n<think>\n\n</think>\n\n",
              "<|im_start", "<|im_end", "im_start|>", "<|im_start|", "<| im_start |>",
              "<|IM_START|>", "<|im_start|x", "<<|im_start|>>", "<|endoftext", "<think",
              "<thinking>", "</ think>", "<|unknown_token|>", "<|im_start|><|im_start",
              "<|object_ref_start|>ref<|object_ref_end|>", "<tool_call>\n{}\n</tool_call>"]:
        add(t)

    # --- a chat-template-like conversation --------------------------------------------------
    add("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nSimple arithmetic.\n</think>\n\n2 + 2 = 4.<|im_end|>\n"
        "<|im_start|>user\nAnd in words? \u8c22\u8c22 \U0001f642<|im_end|>\n"
        "<|im_start|>assistant\n")
    add("<|im_start|>user\nTranslate 'it's' to French.<|im_end|>\n<|im_start|>assistant\nC'est.<|im_end|>")

    # --- mixtures -------------------------------------------------------------------------
    for t in ["Price: 12\u20ac (\u224813.5$) \u2014 \u00e9t\u00e9 2024 \U0001f31e",
              "tab\there\r\nCRLF\rCR\nLF", "  leading and trailing  \t",
              "word\u00a0nbsp\u2009thin\u202fnarrow", "e\u0301t\u00e9 vs \u00e9te\u0301",
              "\u041a\u0438\u0440\u0438\u043b\u043b\u0438\u0446\u0430 and Latin mixed \u0421\u0421\u0421ccc",
              "x\u0000y (NUL)", "\u007f DEL and \u0085 NEL", "\u2028line sep\u2029para sep",
              "\ud7ff\ue000\uffff\U0010ffff"]:
        add(t)
    return out


def jsonl_line(obj):
    """One JSON line, UTF-8 kept readable, but the code points that some line splitters treat
    as line breaks (U+0085, U+2028, U+2029) escaped so every record stays on one line."""
    s = json.dumps(obj, ensure_ascii=False)
    for ch in ("\u0085", "\u2028", "\u2029"):
        s = s.replace(ch, "\\u%04x" % ord(ch))
    return s + "\n"


def main():
    out = lines()
    assert len(set(out)) == len(out), "duplicate corpus lines"
    path = os.path.join(HERE, "corpus.jsonl")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for t in out:
            f.write(jsonl_line({"text": t}))
    print(f"wrote {len(out)} lines to {path}")


if __name__ == "__main__":
    main()
