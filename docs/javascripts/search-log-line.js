/* Pasted log lines: search for the message, not for the noise around it.
 *
 * A line copied from a log carries a rank prefix, a timestamp, a pid, a path and a port. The
 * site's search (lunr, through mkdocs-material) appends a wildcard to every term, so "12*",
 * "3000*" or "in*" match words on every page and bury the runbook that quotes the message.
 * When a whole line arrives at once (a paste) and it contains a message of the error index
 * (runbooks/errors.md, loaded as window.courseErrorMessages) or looks like a log line, this
 * rewrites it before the search runs:
 * 1. the message that decides (the one the fewest pages quote) becomes required words, plus
 *    the token that only the section the index links it to holds in the search index
 *    (tools/site_hooks.py), boosted, so that section comes first; the line's other stable
 *    words follow, to rank the other pages that quote the message;
 * 2. otherwise the query is the line's stable words alone.
 * What is typed key by key is left alone. Tested in a real browser, in both editions, with
 * the lines of tests/pasted_log_lines.py (tests/test_site.py).
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

  // Words as the site's search splits them (its separator, in mkdocs.yml: camelCase and
  // dotted names become words), without the volatile parts, lunr's stop words and the words
  // of one or two letters.
  function stableWords(text) {
    var out = text;
    VOLATILE.forEach(function (pattern) { out = out.replace(pattern, " "); });
    out = out.replace(/[()[\]{}<>=,;|"'`*+~^:!]+/g, " ").replace(/\.(?!\d)/g, " ");
    return out.split(/\s+/).reduce(function (words, word) {
      return words.concat(word.split(/(?<=[a-z0-9])(?=[A-Z][a-z])/));
    }, []).map(function (word) {
      return word.replace(/^[?-]+|[?-]+$/g, "");
    }).filter(function (word) {
      return word.length > 2 && !COMMON.test(word);
    });
  }

  // The index's messages found in the line (entries of window.courseErrorMessages, longest
  // first); none inside another: a found message is blanked out of the text.
  function knownMessages(text) {
    var found = [];
    (window.courseErrorMessages || []).forEach(function (entry) {
      var at = text.indexOf(entry.message);
      if (at !== -1) {
        found.push({entry: entry, at: at});
        text = text.slice(0, at) + " ".repeat(entry.message.length) +
               text.slice(at + entry.message.length);
      }
    });
    return {found: found, rest: text};
  }

  // The message that says most about which page explains the line: the one the fewest pages
  // quote ("EnforceNotMet" over "terminate called after throwing", "ncclRemoteError" over
  // "Connection reset by peer"), then the latest in the line (a line reads from the wrapper
  // to the cause: "Gloo connectFullMesh failed with [...] Connect timeout"), then the longest.
  function decidingFirst(a, b) {
    return a.entry.pages - b.entry.pages || b.at - a.at ||
           b.entry.message.length - a.entry.message.length;
  }

  // The deciding message's words are required (+word): a section that has them all is an
  // answer. Its token, which only the section that explains it holds in the search index
  // (tools/site_hooks.py), puts that section first (^100). The other words, the other
  // messages included, only rank the rest. Required words leave out lunr's stop words: lunr
  // drops those, and a dropped required word matches nothing.
  function rewrite(text) {
    var known = knownMessages(text);
    if (!known.found.length) return looksLikeLogLine(text) ? stableWords(text).join(" ") : "";
    // A message with no stable word (useIpv6: 0) cannot decide: it only ranks.
    var ordered = known.found.sort(decidingFirst).map(function (f) { return f.entry; });
    var deciding = ordered.filter(function (e) { return stableWords(e.message).length; })[0];
    if (!deciding) return stableWords(text).join(" ");
    var required = stableWords(deciding.message).map(function (word) { return "+" + word; });
    var others = ordered.filter(function (e) { return e !== deciding; })
      .map(function (entry) { return entry.message; });
    return required.concat([deciding.token + "^100"],
                           stableWords(others.join(" ") + " " + known.rest)).join(" ");
  }

  // Capture phase on the document: runs before the theme reads the input's value. A paste, or
  // a whole line inserted at once, brings more than one character in one event; a key brings
  // one.
  document.addEventListener("input", function (event) {
    var input = event.target;
    if (!(input.matches && input.matches("input.md-search__input"))) return;
    var atOnce = event.inputType === "insertFromPaste" || (event.data || "").length > 1;
    var query = atOnce && rewrite(input.value);
    if (query) input.value = query;
  }, true);
})();
