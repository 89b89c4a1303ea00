// dtk::text — Unicode normalization form C (NFC), as Hugging Face's NFC normalizer applies it to
// the text between added tokens (Qwen's tokenizer.json): full canonical decomposition (Hangul
// syllables by the algorithm), canonical ordering of the combining marks, then canonical
// composition. Tables: core/text/src/nfc_tables.inc (tools/gen_nfc_tables.py, from Python's
// unicodedata; code points assigned after that Unicode version pass unchanged). Malformed
// UTF-8 throws DataError "invalid UTF-8 at byte N".
#pragma once

#include <string>
#include <string_view>

namespace dtk::text {

// `text` in NFC: `text` itself when nothing in it can change (every code point below U+0300, the
// first combining mark), else the normalized text written to `*storage` and viewed.
std::string_view nfc(std::string_view text, std::string* storage);

}  // namespace dtk::text
