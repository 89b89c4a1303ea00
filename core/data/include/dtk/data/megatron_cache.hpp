// dtk::data — what Megatron's index caches are named by: the md5 of a description text, the
// description itself (Megatron-core: Python's json.dumps(indent=4) of an ordered dict; legacy
// Megatron: a few lines of text), and the Python and numpy formatting those texts are made of
// (float repr, numpy's pairwise sum in normalize(), numpy's str() of a float array).
// Written from the public algorithms (RFC 1321, CPython's repr, numpy's array2string); tested
// against hashlib, json and numpy output committed as fixtures (tools/fixtures/megatron_caches.py).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtk::data {

// RFC 1321 md5 of `bytes`, 32 lowercase hex digits (hashlib.md5(bytes).hexdigest()).
std::string md5_hex(const std::string& bytes);

// Python's repr(float): the shortest digits that round-trip, "1.0", "0.969", "1e-05", "1e+16".
std::string python_float_repr(double x);

// numpy.sum of a float64 vector (numpy's pairwise summation: 8 partial sums per block of <= 128).
double numpy_sum(const std::vector<double>& v);
// Megatron-core's utils.normalize: numpy w / numpy.sum(w).
std::vector<double> numpy_normalize(const std::vector<double>& w);
// str(numpy.array(v, dtype=float64)) with numpy's default print options, for values that print
// without an exponent (what legacy Megatron's blend description holds). Returns "" for arrays
// it does not format (an exponent needed, a line longer than 75 characters, not finite).
std::string numpy_float_array_str(const std::vector<double>& v);

// A JSON value as Python's json module reads and writes it: objects keep their key order,
// integers and floats stay apart (1 and 1.0 print differently).
struct PyJson {
  enum class Kind { kNull, kBool, kInt, kFloat, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<PyJson> items;
  std::vector<std::pair<std::string, PyJson>> members;

  static PyJson null() { return PyJson(); }
  static PyJson boolean(bool v);
  static PyJson integer(int64_t v);
  static PyJson real(double v);
  static PyJson string(std::string v);
  static PyJson array(std::vector<PyJson> v = {});
  static PyJson object();
  PyJson& set(const std::string& key, PyJson value);  // appends (objects only)
  const PyJson* find(const std::string& key) const;   // nullptr when absent or not an object
};

// json.loads (strict enough for Megatron's description files); throws DataError naming `what`.
PyJson parse_json(const std::string& text, const std::string& what);
// json.dumps(value, indent=4) (ensure_ascii, separators ", " / ": " as Python's indent mode).
std::string dumps_indent4(const PyJson& value);

}  // namespace dtk::data
