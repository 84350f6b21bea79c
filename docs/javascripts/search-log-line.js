/* Pasted log lines: search for the message, not for the noise around it.
 *
 * A line copied from a log carries a rank prefix, a timestamp, a pid, a path and a port. The
 * site's search (lunr, through mkdocs-material) appends a wildcard to every term, so "12*",
 * "3000*" or "in*" match words on every page and bury the runbook that quotes the message.
 * When the query looks like a log line, this rewrites it before the search runs:
 * 1. the longest message of the error index (runbooks/errors.md, loaded as
 *    window.courseErrorMessages) that the line contains goes in quotes, which the theme turns
 *    into "every word required", followed by the line's other stable words; the pages that
 *    own a common message get a search boost (SEARCH_SETTINGS in tools/site_hooks.py);
 * 2. otherwise the query is the line's stable words alone.
 * Short queries typed by hand are left alone. Tested by tests/test_site.py
 * (test_pasted_log_lines_find_their_page).
 */
(function () {
  "use strict";

  // The parts of a log line that change from run to run (the index's rule for an entry).
  var VOLATILE = [
    /\[(?:rank|Rank) ?\d+\]:?/g,                       // [rank0]: and [Rank 0]
    /\[[EWIF]\d{4} [^\]]*\]/g,                         // glog prefix [E1129 12:10:58.48 file.cpp:67]
    /\[PG ID [^\]]*\]/g,                               // [PG ID 0 PG GUID 0(default_pg) Rank 1]
    /\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d[.,\d]*/g,       // 2026-12-01 12:00:00,123
    /\d\d:\d\d:\d\d[.,\d]*/g,                          // 12:10:58.481120910
    /\S*\/\S*/g,                                       // paths, and counts such as 1/2
    /\S+\.(?:cpp|cc|h|hpp|py|cu):\d+\S*/g,             // ProcessGroupNCCL.cpp:1234
    /\[?\d+(?:\.\d+){3}\]?(?::\d+)?/g,                 // 127.0.0.1:29500, [10.0.0.1]:5020
    /\b0x[0-9a-fA-F]+\b/g,                             // addresses
    /\S*\d\S*/g                                        // anything else with a digit in it
  ];
  // lunr's English stop words (a required stop word matches nothing, so the search would come
  // back empty) and words that match half the site once a wildcard is appended.
  var COMMON = new RegExp("^(?:" + [
    "a able about across after all almost also am among an and any are as at be because been",
    "but by can cannot could dear did do does either else ever every for from get got had has",
    "have he her hers him his how however i if in into is it its just least let like likely may",
    "me might most must my neither no nor not of off often on only or other our own rather",
    "said say says she should since so some than that the their them then there these they",
    "this tis to too twas us wants was we were what when where which while who whom why will",
    "with would yet you your before error errors"].join(" ").split(" ").join("|") + ")$", "i");

  function looksLikeLogLine(text) {
    return text.trim().split(/\s+/).length >= 6 && /\d/.test(text);
  }

  function stableWords(text) {
    var out = text;
    VOLATILE.forEach(function (pattern) { out = out.replace(pattern, " "); });
    return out.replace(/[()[\]{}<>=,;|"'`*+~^:]+/g, " ").split(/\s+/).map(function (word) {
      return word.replace(/^[.!?-]+|[.!?-]+$/g, "");
    }).filter(function (word) {
      return word.length > 2 && !COMMON.test(word);
    });
  }

  // The index's messages found in the line, longest first, none inside another.
  function knownMessages(text) {
    var found = [];
    (window.courseErrorMessages || []).forEach(function (message) {
      if (text.indexOf(message) !== -1) {
        found.push(message);
        text = text.replace(message, " ");
      }
    });
    return {messages: found, rest: text};
  }

  // Only the longest message is required: a section that quotes it is an answer. (Requiring
  // every message found fails when a page quotes them in different sections.) The other
  // words, shorter messages included, only rank the sections that have it. Required words
  // leave out lunr's stop words: lunr drops those, and a dropped required word matches nothing.
  function rewrite(text) {
    var known = knownMessages(text);
    if (!known.messages.length) return stableWords(text).join(" ");
    var required = '"' + stableWords(known.messages[0]).join(" ") + '"';
    var others = stableWords(known.messages.slice(1).join(" ") + " " + known.rest);
    return [required].concat(others).join(" ");
  }

  // Capture phase on the document: runs before the theme reads the input's value.
  document.addEventListener("input", function (event) {
    var input = event.target;
    if (!(input.matches && input.matches("input.md-search__input"))) return;
    if (!looksLikeLogLine(input.value)) return;
    var query = rewrite(input.value);
    if (query) input.value = query;
  }, true);
})();
