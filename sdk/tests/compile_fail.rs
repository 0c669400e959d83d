//! `#[plugin]` misuse is a compile error naming the attribute and the fix.

#[test]
fn misuses_of_the_plugin_attribute_do_not_compile() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
