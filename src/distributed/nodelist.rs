//! SLURM's compressed host lists (`SLURM_JOB_NODELIST`): `gpu[01-04,07]`, `a1,b[2-3]`,
//! `rack[1-2]-n[01-02]`. Numbers keep the zero padding of the range's low bound.

/// One host pattern: literal text and bracketed number ranges, in order.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    /// (low, high, digits), in the order written.
    Ranges(Vec<(u64, u64, usize)>),
}

/// Hosts one list may expand to (a longer one is refused rather than allocated).
const MAX_HOSTS: usize = 1 << 20;

fn parse_ranges(inner: &str) -> Result<Vec<(u64, u64, usize)>, String> {
    if inner.trim().is_empty() {
        return Err("empty brackets".into());
    }
    inner
        .split(',')
        .map(|r| {
            let r = r.trim();
            let (lo, hi) = r.split_once('-').unwrap_or((r, r));
            let num = |s: &str| -> Result<u64, String> {
                if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!("{r:?} is not a number or a range a-b"));
                }
                s.parse::<u64>()
                    .map_err(|_| format!("{s:?} is too large a number"))
            };
            let (l, h) = (num(lo)?, num(hi)?);
            if h < l {
                return Err(format!("range {r:?} runs backwards"));
            }
            Ok((l, h, lo.len()))
        })
        .collect()
}

fn parse_host(item: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = item;
    while !rest.is_empty() {
        match rest.find(['[', ']']) {
            None => {
                parts.push(Part::Text(rest.to_string()));
                rest = "";
            }
            Some(i) if rest.as_bytes()[i] == b']' => {
                return Err(format!("{item:?}: a ']' without its '['"))
            }
            Some(i) => {
                if i > 0 {
                    parts.push(Part::Text(rest[..i].to_string()));
                }
                let after = &rest[i + 1..];
                let Some(close) = after.find(']') else {
                    return Err(format!("{item:?}: a '[' without its ']'"));
                };
                let inner = &after[..close];
                if inner.contains('[') {
                    return Err(format!("{item:?}: nested '['"));
                }
                parts.push(Part::Ranges(
                    parse_ranges(inner).map_err(|e| format!("{item:?}: {e}"))?,
                ));
                rest = &after[close + 1..];
            }
        }
    }
    if parts.is_empty() {
        return Err("an empty host name".into());
    }
    Ok(parts)
}

/// The host patterns of a list: split at the commas outside brackets.
fn parse(list: &str) -> Result<Vec<Vec<Part>>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("empty".into());
    }
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            c if c.is_whitespace() => return Err(format!("a space in {list:?}")),
            _ => {}
        }
    }
    items.push(&list[start..]);
    items
        .into_iter()
        .map(|item| {
            if item.is_empty() {
                Err("an empty host name (two commas, or one at an end)".into())
            } else {
                parse_host(item)
            }
        })
        .collect()
}

fn pad(n: u64, digits: usize) -> String {
    format!("{n:0digits$}")
}

/// Every host of a list, in order.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for parts in parse(list)? {
        let mut hosts = vec![String::new()];
        for p in &parts {
            match p {
                Part::Text(t) => hosts.iter_mut().for_each(|h| h.push_str(t)),
                Part::Ranges(rs) => {
                    let count: u64 = rs.iter().map(|(l, h, _)| h - l + 1).sum();
                    if (hosts.len() as u64).saturating_mul(count) > MAX_HOSTS as u64 {
                        return Err(format!("more than {MAX_HOSTS} hosts"));
                    }
                    hosts = hosts
                        .iter()
                        .flat_map(|h| {
                            rs.iter().flat_map(move |&(l, hi, d)| {
                                (l..=hi).map(move |n| format!("{h}{}", pad(n, d)))
                            })
                        })
                        .collect();
                }
            }
        }
        if out.len() + hosts.len() > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        out.extend(hosts);
    }
    Ok(out)
}

/// The first host of a list (where SLURM starts task 0), after checking the whole list.
pub fn first_host(list: &str) -> Result<String, String> {
    let items = parse(list)?;
    let first = items.first().ok_or_else(|| "empty".to_string())?;
    Ok(first
        .iter()
        .map(|p| match p {
            Part::Text(t) => t.clone(),
            Part::Ranges(rs) => rs.first().map_or(String::new(), |&(l, _, d)| pad(l, d)),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressed_lists_expand_in_order_with_their_padding() {
        assert_eq!(
            expand("gpu[01-04,07]").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(expand("a1,b[2-3]").unwrap(), ["a1", "b2", "b3"]);
        assert_eq!(expand("node7").unwrap(), ["node7"]);
        assert_eq!(
            expand("r[1-2]-n[08-09]").unwrap(),
            ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]
        );
        assert_eq!(
            expand("x[098-101]").unwrap(),
            ["x098", "x099", "x100", "x101"]
        );
        assert_eq!(expand("n[5],m").unwrap(), ["n5", "m"]);
        assert_eq!(first_host("gpu[01-04,07]").unwrap(), "gpu01");
        assert_eq!(first_host("a1,b[2-3]").unwrap(), "a1");
        assert_eq!(first_host("r[3-4]-n[007,1]").unwrap(), "r3-n007");
        assert_eq!(
            first_host("host-1.cluster.org").unwrap(),
            "host-1.cluster.org"
        );
    }

    #[test]
    fn lists_that_do_not_parse_say_why() {
        for (bad, why) in [
            ("gpu[01-", "without its ']'"),
            ("gpu]01", "without its '['"),
            ("gpu[]", "empty brackets"),
            ("gpu[04-01]", "backwards"),
            ("gpu[a-b]", "not a number"),
            ("a,,b", "empty host"),
            ("a,", "empty host"),
            ("", "empty"),
            ("gpu[1-[2]]", "nested"),
            ("a b", "space"),
            ("n[0-99999999999]", "more than"),
        ] {
            let e = expand(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!(first_host("gpu[01-").is_err());
        assert!(first_host("ok,bad[").is_err());
    }
}
